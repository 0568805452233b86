package failpoint

import (
	"strconv"
	"strings"
	"testing"
)

// FuzzParse: whatever TXBOX_FAILPOINTS holds, parsing never panics, every armed point acts on a
// hit from the first on and has an action, and writing the points back out in the documented
// syntax parses to the same points.
func FuzzParse(f *testing.F) {
	for _, spec := range []string{
		"", " ", ",,,", "relay.after-publish", "kafka.before-commit=stop@3,relay.lease-locked@2",
		" x , y=kill@0", "a@-1", "a@99999999999999999999", "a=stop@", "a@1@2", "=stop", "@", "=", "a=b=c@4",
		"inbox.after-commit@2,inbox.after-commit@5", "é=stop@7\t",
	} {
		f.Add(spec)
	}
	f.Fuzz(func(t *testing.T, spec string) {
		points := parse(spec)
		if spec == "" && points != nil {
			t.Fatalf("an empty spec armed %v", points)
		}
		items := make([]string, 0, len(points))
		for name, p := range points {
			if p.nth < 1 {
				t.Errorf("%q: hit %d of %q can never happen", spec, p.nth, name)
			}
			if p.action == "" {
				t.Errorf("%q: %q has no action", spec, name)
			}
			items = append(items, name+"="+p.action+"@"+strconv.Itoa(p.nth))
		}
		again := parse(strings.Join(items, ","))
		if len(points) > 0 && len(again) != len(points) {
			t.Fatalf("%q parsed to %v; written back as %q it parses to %v", spec, points, strings.Join(items, ","), again)
		}
		for name, p := range points {
			if again[name] != p {
				t.Errorf("%q: %q parsed to %+v; written back it parses to %+v", spec, name, p, again[name])
			}
		}
	})
}
