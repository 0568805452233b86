package monitoring_test

import (
	"encoding/json"
	"os"
	"reflect"
	"regexp"
	"slices"
	"sort"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"github.com/stretchr/testify/require"

	"github.com/txbox/txbox/internal/metrics"
)

// metric is one metric family txbox exports.
type metric struct {
	histogram bool
	labels    []string // sorted
}

// exported registers every collector of internal/metrics and returns the families by name. Vectors
// with no series yet still count: their names and labels come from their descriptions.
func exported(t *testing.T) map[string]metric {
	t.Helper()
	reg := prometheus.NewRegistry()
	sets := []any{
		metrics.NewInbox(reg, "s"),
		metrics.NewRelay(reg, "s"),
		metrics.NewCalls(reg, "s"),
		metrics.NewConsumerLag(reg),
	}
	out := map[string]metric{}
	for _, set := range sets {
		v := reflect.Indirect(reflect.ValueOf(set))
		for i := range v.NumField() {
			c, ok := v.Field(i).Interface().(prometheus.Collector)
			require.True(t, ok, "%s.%s is not a collector", v.Type(), v.Type().Field(i).Name)
			name, labels := describe(t, c)
			out[name] = metric{histogram: isHistogram(t, c), labels: labels}
		}
	}
	_, err := reg.Gather()
	require.NoError(t, err, "the collectors are consistent")
	return out
}

var (
	descName   = regexp.MustCompile(`^Desc\{fqName: "([^"]+)"`)
	descLabels = regexp.MustCompile(`variableLabels: \{([^}]*)\}\}$`)
)

// describe returns the name and the label names of the one family c describes.
func describe(t *testing.T, c prometheus.Collector) (string, []string) {
	t.Helper()
	ch := make(chan *prometheus.Desc, 4)
	c.Describe(ch)
	close(ch)
	var descs []*prometheus.Desc
	for d := range ch {
		descs = append(descs, d)
	}
	require.Len(t, descs, 1)
	s := descs[0].String()
	name, labels := descName.FindStringSubmatch(s), descLabels.FindStringSubmatch(s)
	require.NotNil(t, name, s)
	require.NotNil(t, labels, s)
	var out []string
	for l := range strings.SplitSeq(labels[1], ",") {
		if l = strings.TrimSpace(l); l != "" {
			out = append(out, l)
		}
	}
	sort.Strings(out)
	return name[1], out
}

func isHistogram(t *testing.T, c prometheus.Collector) bool {
	t.Helper()
	switch c.(type) {
	case *prometheus.HistogramVec, prometheus.Histogram:
		return true
	case *prometheus.CounterVec, *prometheus.GaugeVec:
		return false
	}
	ch := make(chan prometheus.Metric, 1)
	c.Collect(ch)
	close(ch)
	m, ok := <-ch
	require.True(t, ok, "a single series collects itself")
	var pb dto.Metric
	require.NoError(t, m.Write(&pb))
	return pb.Histogram != nil
}

// series maps every series name txbox exports (a histogram's _bucket, _sum and _count) to its
// labels, le included for buckets.
func series(all map[string]metric) map[string][]string {
	out := map[string][]string{}
	for name, m := range all {
		if !m.histogram {
			out[name] = m.labels
			continue
		}
		out[name+"_bucket"] = append(slices.Clone(m.labels), "le")
		out[name+"_sum"] = m.labels
		out[name+"_count"] = m.labels
	}
	return out
}

// Every txbox_ name in internal/metrics' source is a collector the test registers, so a collector
// added to the package without being added here fails the test.
func TestEveryCollectorIsChecked(t *testing.T) {
	t.Parallel()
	src, err := os.ReadFile("../internal/metrics/metrics.go")
	require.NoError(t, err)
	var inSource []string
	for _, m := range regexp.MustCompile(`"(txbox_[a-z0-9_]+)"`).FindAllStringSubmatch(string(src), -1) {
		inSource = append(inSource, m[1])
	}
	var registered []string
	for name := range exported(t) {
		registered = append(registered, name)
	}
	require.ElementsMatch(t, slices.Compact(sorted(inSource)), registered)
}

var (
	selector = regexp.MustCompile(`\b(txbox_[a-z0-9_]+)\b(\{[^}]*\})?`)
	matcher  = regexp.MustCompile(`([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)`)
	grouping = regexp.MustCompile(`\b(?:by|without|on|ignoring)\s*\(([^)]*)\)`)
)

// commonLabels may be on any series: Prometheus adds them at scrape time.
var commonLabels = []string{"instance", "job"}

// checkExpr reports names in expr that txbox does not export, and labels that none of the
// expression's metrics has.
func checkExpr(t *testing.T, where, expr string, exp map[string][]string) {
	t.Helper()
	var labelsHere []string
	found := false
	for _, m := range selector.FindAllStringSubmatch(expr, -1) {
		labels, ok := exp[m[1]]
		if !ok {
			t.Errorf("%s: %s is not a metric txbox exports (a histogram is queried by its _bucket, _sum or _count)", where, m[1])
			continue
		}
		found = true
		labelsHere = append(labelsHere, labels...)
		for _, lm := range matcher.FindAllStringSubmatch(m[2], -1) {
			if lm[1] != "__name__" && !slices.Contains(labels, lm[1]) && !slices.Contains(commonLabels, lm[1]) {
				t.Errorf("%s: %s has no label %q (it has %v)", where, m[1], lm[1], labels)
			}
		}
	}
	if !found {
		t.Errorf("%s: names no txbox metric: %s", where, expr)
	}
	for _, g := range grouping.FindAllStringSubmatch(expr, -1) {
		for l := range strings.SplitSeq(g[1], ",") {
			l = strings.TrimSpace(l)
			if l != "" && l != "le" && !slices.Contains(labelsHere, l) && !slices.Contains(commonLabels, l) {
				t.Errorf("%s: groups by %q, a label none of its metrics has: %s", where, l, expr)
			}
		}
	}
}

// The dashboard is valid JSON, every panel has a query, and every query names exported metrics
// with labels they have.
func TestDashboardQueriesExportedMetrics(t *testing.T) {
	t.Parallel()
	raw, err := os.ReadFile("dashboard.json")
	require.NoError(t, err)
	var d struct {
		Title  string `json:"title"`
		UID    string `json:"uid"`
		Panels []struct {
			Type    string `json:"type"`
			Title   string `json:"title"`
			Targets []struct {
				Expr string `json:"expr"`
			} `json:"targets"`
		} `json:"panels"`
		Templating struct {
			List []struct {
				Name       string `json:"name"`
				Definition string `json:"definition"`
			} `json:"list"`
		} `json:"templating"`
	}
	require.NoError(t, json.Unmarshal(raw, &d), "dashboard.json is not valid JSON")
	require.NotEmpty(t, d.Title)
	require.NotEmpty(t, d.UID)
	exp := series(exported(t))
	queried := 0
	for _, p := range d.Panels {
		if p.Type == "row" {
			continue
		}
		require.NotEmpty(t, p.Targets, "panel %q has no query", p.Title)
		for _, tg := range p.Targets {
			checkExpr(t, "dashboard panel "+p.Title, tg.Expr, exp)
			queried++
		}
	}
	require.NotZero(t, queried)
	for _, v := range d.Templating.List {
		if v.Definition != "" {
			checkExpr(t, "dashboard variable "+v.Name, v.Definition, exp)
		}
	}
}

var (
	exprLine  = regexp.MustCompile(`(?m)^\s+expr:\s*(\|)?(.*)$`)
	alertLine = regexp.MustCompile(`(?m)^\s+- alert:\s*(\S+)`)
	// A promtool test's input series: series: 'name{labels}'.
	inputSeries = regexp.MustCompile(`(?m)^\s+- series:\s*'([^']*)'`)
	alertTested = regexp.MustCompile(`(?m)^\s+alertname:\s*(\S+)`)
)

// exprs returns the expressions of alerts.yml: single-line ones and block scalars (expr: |).
func exprs(src string) []string {
	lines := strings.Split(src, "\n")
	var out []string
	for i, line := range lines {
		m := exprLine.FindStringSubmatch(line)
		if m == nil {
			continue
		}
		if m[1] == "" {
			out = append(out, strings.TrimSpace(m[2]))
			continue
		}
		indent := len(line) - len(strings.TrimLeft(line, " "))
		var block []string
		for _, next := range lines[i+1:] {
			if strings.TrimSpace(next) != "" && len(next)-len(strings.TrimLeft(next, " ")) <= indent {
				break
			}
			block = append(block, strings.TrimSpace(next))
		}
		out = append(out, strings.Join(block, " "))
	}
	return out
}

// The alert rules name exported metrics with labels they have; every alert has a summary, a
// description and a runbook, and promtool tests; the tests' input series are real series with
// real labels.
func TestAlertRulesQueryExportedMetrics(t *testing.T) {
	t.Parallel()
	raw, err := os.ReadFile("alerts.yml")
	require.NoError(t, err)
	src := string(raw)
	exp := series(exported(t))

	es := exprs(src)
	alerts := alertLine.FindAllStringSubmatch(src, -1)
	require.Len(t, es, len(alerts), "one expression per alert")
	for i, e := range es {
		checkExpr(t, "alert "+alerts[i][1], e, exp)
	}
	for _, section := range strings.Split(src, "- alert:")[1:] {
		name := strings.Fields(section)[0]
		for _, a := range []string{"summary:", "description:", "runbook:", "severity:"} {
			require.Contains(t, section, a, "alert %s", name)
		}
	}

	rawTests, err := os.ReadFile("alerts_test.yml")
	require.NoError(t, err)
	tests := string(rawTests)
	tested := map[string]bool{}
	for _, m := range alertTested.FindAllStringSubmatch(tests, -1) {
		tested[m[1]] = true
	}
	for _, a := range alerts {
		require.True(t, tested[a[1]], "alert %s has no promtool test", a[1])
	}
	inputs := inputSeries.FindAllStringSubmatch(tests, -1)
	require.NotEmpty(t, inputs)
	for _, in := range inputs {
		checkExpr(t, "promtool input series", in[1], exp)
	}
}

var readmeRow = regexp.MustCompile("`(txbox_[a-z0-9_]+)(?:\\{([a-z_,]*)\\})?`")

// The README's metric table lists exactly the exported metrics, each with its labels.
func TestReadmeListsEveryMetric(t *testing.T) {
	t.Parallel()
	raw, err := os.ReadFile("../README.md")
	require.NoError(t, err)
	readme := string(raw)
	start := strings.Index(readme, "### Metrics")
	require.NotEqual(t, -1, start, "README has a Metrics section")
	section := readme[start+len("### Metrics"):]
	section = section[:strings.Index(section, "\n#")]

	listed := map[string][]string{}
	for _, line := range strings.Split(section, "\n") {
		if !strings.HasPrefix(line, "| `txbox_") {
			continue
		}
		first := strings.SplitN(line, " | ", 2)[0]
		for _, m := range readmeRow.FindAllStringSubmatch(first, -1) {
			var labels []string
			if m[2] != "" {
				labels = strings.Split(m[2], ",")
			}
			listed[m[1]] = sorted(labels)
		}
	}
	want := map[string][]string{}
	for name, m := range exported(t) {
		want[name] = m.labels
	}
	require.Equal(t, want, listed, "README's metric table (name{labels}) against what internal/metrics exports")
}

func sorted(s []string) []string {
	s = slices.Clone(s)
	sort.Strings(s)
	return s
}
