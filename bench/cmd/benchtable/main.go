// Benchtable reads `go test -bench` output of ./bench on standard input and prints two Markdown
// tables: the figures issue 11 asks for, each txbox's number against its baseline from the same run
// with the goal and whether it is met; then every result, for what the figures leave out.
//
//	go test -run '^$' -bench . ./bench/ | go run ./bench/cmd/benchtable
//
// A result seen more than once (-count) is summarised by its median, and a ratio by the median of
// each round's ratio. A figure whose benchmarks did not run is shown as not measured, never as met.
package main

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"os"
	"regexp"
	"slices"
	"strconv"
	"strings"
)

func main() {
	if err := run(os.Stdin, os.Stdout); err != nil {
		fmt.Fprintln(os.Stderr, "benchtable:", err)
		os.Exit(1)
	}
}

// ref names one metric of one benchmark: its name without Benchmark and the -GOMAXPROCS suffix, and
// the unit it reports.
type ref struct{ bench, unit string }

// goal is what a figure must reach: a ratio to the baseline of at least minRatio, or txbox's own
// value at most maxValue; neither set means the figure is reported without a goal.
type goal struct {
	minRatio, maxValue float64
}

type figure struct {
	name            string
	txbox, baseline ref
	// lowerIsBetter flips the ratio to baseline/txbox, so a ratio above 1 always favours txbox.
	lowerIsBetter bool
	goal          goal
}

// figures are issue 11's: each names the benchmark variant that measures it and its baseline.
var figures = []figure{
	{name: "relay drain, warm backlog, defaults (vs raw idempotent producer)",
		txbox: ref{"RelayDrainWarm/txbox", "msgs/s"}, baseline: ref{"RelayDrainWarm/raw-idempotent-producer", "msgs/s"},
		goal: goal{minRatio: 0.9}},
	{name: "bound: the relay's database work alone, warm, no broker (vs raw idempotent producer)",
		txbox: ref{"RelayDrainWarm/txbox-no-broker", "msgs/s"}, baseline: ref{"RelayDrainWarm/raw-idempotent-producer", "msgs/s"}},
	{name: "relay drain, warm backlog, defaults (vs Watermill forwarder)",
		txbox: ref{"RelayDrainWarm/txbox", "msgs/s"}, baseline: ref{"RelayDrainWarm/watermill-forwarder", "msgs/s"}},
	{name: "relay started on a backlog, start-up counted (vs forwarder)",
		txbox: ref{"RelayDrain/txbox-transactional", "msgs/s"}, baseline: ref{"RelayDrain/watermill-forwarder", "msgs/s"},
		goal: goal{minRatio: 8}},
	{name: "commit → consumer p50 at 500 msg/s, defaults (vs forwarder, 10 ms poll)",
		txbox: ref{"Latency/txbox", "p50-ms"}, baseline: ref{"Latency/watermill-forwarder", "p50-ms"},
		lowerIsBetter: true, goal: goal{maxValue: 2}},
	{name: "commit → consumer p99 at 500 msg/s, defaults (vs forwarder, 10 ms poll)",
		txbox: ref{"Latency/txbox", "p99-ms"}, baseline: ref{"Latency/watermill-forwarder", "p99-ms"},
		lowerIsBetter: true, goal: goal{maxValue: 8}},
	{name: "idle CPU of the process (vs forwarder)",
		txbox: ref{"Latency/txbox", "idle-cpu-ms/s"}, baseline: ref{"Latency/watermill-forwarder", "idle-cpu-ms/s"},
		lowerIsBetter: true},
	{name: "idle CPU of its PostgreSQL backends (vs forwarder)",
		txbox: ref{"Latency/txbox", "idle-db-cpu-ms/s"}, baseline: ref{"Latency/watermill-forwarder", "idle-db-cpu-ms/s"},
		lowerIsBetter: true},
	{name: "outbox write, 1 msg/tx (vs plain INSERT)",
		txbox: ref{"OutboxPublish/1-msg-per-tx", "txbox-msgs/s"}, baseline: ref{"OutboxPublish/1-msg-per-tx", "plain-insert-msgs/s"},
		goal: goal{minRatio: 0.95}},
	{name: "outbox write, 100 msgs/tx (vs plain multi-row INSERT)",
		txbox: ref{"OutboxPublish/100-msgs-per-tx", "txbox-msgs/s"}, baseline: ref{"OutboxPublish/100-msgs-per-tx", "plain-insert-msgs/s"},
		goal: goal{minRatio: 0.85}},
	{name: "inbox, fresh message through a Watermill router (vs bare handler)",
		txbox: ref{"InboxRouter/inbox-fresh", "msgs/s"}, baseline: ref{"InboxRouter/bare-handler", "msgs/s"},
		goal: goal{minRatio: 0.85}},
	{name: "bound: an inbox row and crash marker in plain SQL (vs plain transaction)",
		txbox: ref{"InboxDedup/sql-floor-row-and-marker", "msgs/s"}, baseline: ref{"InboxDedup/plain-tx", "msgs/s"}},
}

// builtin metrics say nothing about a pipeline's speed here: an op is one message or one drain.
var builtin = map[string]bool{"ns/op": true, "B/op": true, "allocs/op": true, "MB/s": true}

var (
	resultLine = regexp.MustCompile(`^Benchmark(\S+?)(?:-(\d+))?\s+(\d+)\s+(.*)$`)
	cpuLine    = regexp.MustCompile(`^cpu:\s*(.*?)\s*$`)
)

// bench is one benchmark's results: each unit's values, units in order of first appearance.
type bench struct {
	name   string
	units  []string
	values map[string][]float64
}

type results struct {
	benches []*bench
	cpu     string
	procs   string
}

func parse(r io.Reader) (*results, error) {
	res := &results{}
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		if m := cpuLine.FindStringSubmatch(line); m != nil {
			res.cpu = m[1]
			continue
		}
		m := resultLine.FindStringSubmatch(line)
		if m == nil {
			continue
		}
		name, procs, rest := m[1], m[2], m[4]
		if procs != "" {
			res.procs = procs
		}
		bn := res.bench(name)
		fields := strings.Fields(rest)
		for i := 0; i+1 < len(fields); i += 2 {
			val, err := strconv.ParseFloat(fields[i], 64)
			if err != nil {
				return nil, fmt.Errorf("%q: value %q: %w", line, fields[i], err)
			}
			unit := fields[i+1]
			if builtin[unit] {
				continue
			}
			if _, seen := bn.values[unit]; !seen {
				bn.units = append(bn.units, unit)
			}
			bn.values[unit] = append(bn.values[unit], val)
		}
	}
	if err := sc.Err(); err != nil {
		return nil, err
	}
	if len(res.benches) == 0 {
		return nil, errors.New("no benchmark results in the input")
	}
	return res, nil
}

func (res *results) bench(name string) *bench {
	if i := slices.IndexFunc(res.benches, func(b *bench) bool { return b.name == name }); i >= 0 {
		return res.benches[i]
	}
	b := &bench{name: name, values: map[string][]float64{}}
	res.benches = append(res.benches, b)
	return b
}

// values are the results r names, in the order they were reported.
func (res *results) values(r ref) []float64 {
	i := slices.IndexFunc(res.benches, func(b *bench) bool { return b.name == r.bench })
	if i < 0 {
		return nil
	}
	return res.benches[i].values[r.unit]
}

// ratio is txbox's result over the baseline's (the inverse when lower is better), the median of
// each run's own ratio when both ran as often: the n-th results of two benchmarks come from the
// same round of -count, close in time, so a ratio of the two meets less of the load that varied
// between rounds than a ratio of medians would.
func (f figure) ratio(tv, bv []float64) (float64, bool) {
	of := func(t, b float64) float64 {
		if f.lowerIsBetter {
			return b / t
		}
		return t / b
	}
	if len(tv) == len(bv) && len(tv) > 0 && !slices.Contains(tv, 0) && !slices.Contains(bv, 0) {
		ratios := make([]float64, len(tv))
		for i := range tv {
			ratios[i] = of(tv[i], bv[i])
		}
		return median(ratios)
	}
	t, tok := median(tv)
	b, bok := median(bv)
	if !tok || !bok || t == 0 || b == 0 {
		return 0, false
	}
	return of(t, b), true
}

func median(vs []float64) (float64, bool) {
	if len(vs) == 0 {
		return 0, false
	}
	s := slices.Sorted(slices.Values(vs))
	if len(s)%2 == 1 {
		return s[len(s)/2], true
	}
	return (s[len(s)/2-1] + s[len(s)/2]) / 2, true
}

func run(in io.Reader, out io.Writer) error {
	res, err := parse(in)
	if err != nil {
		return err
	}
	write(out, res)
	return nil
}

func write(out io.Writer, res *results) {
	if res.cpu != "" || res.procs != "" {
		fmt.Fprintf(out, "CPU: %s, GOMAXPROCS %s\n\n", orDash(res.cpu), orDash(res.procs))
	}
	fmt.Fprintln(out, "| figure | txbox | baseline | ratio | goal | met? |")
	fmt.Fprintln(out, "|---|---:|---:|---:|---|---|")
	for _, f := range figures {
		fmt.Fprintf(out, "| %s |\n", strings.Join(f.row(res), " | "))
	}
	fmt.Fprintln(out)
	fmt.Fprintln(out, "| benchmark | results |")
	fmt.Fprintln(out, "|---|---|")
	for _, b := range res.benches {
		var cells []string
		for _, u := range b.units {
			v, _ := median(b.values[u])
			cells = append(cells, format(v, u)+" "+u)
		}
		fmt.Fprintf(out, "| %s | %s |\n", b.name, strings.Join(cells, " · "))
	}
}

// row is a figure's cells after its name: txbox, baseline, ratio, goal, met.
func (f figure) row(res *results) []string {
	row := []string{f.name, "–", "–", "–", f.goal.String(f.txbox.unit), ""}
	tvs, bvs := res.values(f.txbox), res.values(f.baseline)
	tv, tok := median(tvs)
	if tok {
		row[1] = format(tv, f.txbox.unit) + " " + display(f.txbox.unit)
	}
	if bv, ok := median(bvs); ok {
		row[2] = format(bv, f.baseline.unit) + " " + display(f.baseline.unit)
	}
	ratio, rok := f.ratio(tvs, bvs)
	if rok {
		row[3] = fmt.Sprintf("%.2f×", ratio)
	}
	switch {
	case f.goal == goal{}:
	case f.goal.minRatio > 0 && !rok, f.goal.maxValue > 0 && !tok:
		row[5] = "not measured"
	case f.goal.minRatio > 0:
		row[5] = yesNo(ratio >= f.goal.minRatio)
	default:
		row[5] = yesNo(tv <= f.goal.maxValue)
	}
	return row
}

func (g goal) String(unit string) string {
	switch {
	case g.minRatio > 0:
		return fmt.Sprintf("≥ %g×", g.minRatio)
	case g.maxValue > 0:
		return fmt.Sprintf("≤ %g %s", g.maxValue, display(unit))
	}
	return "–"
}

func yesNo(met bool) string {
	if met {
		return "yes"
	}
	return "**no**"
}

// display is how the figures table names a unit: which variant reported a rate, or which
// percentile a latency is, is already in the figure's name.
func display(unit string) string {
	switch {
	case strings.HasSuffix(unit, "msgs/s"):
		return "msgs/s"
	case strings.HasPrefix(unit, "idle-") && strings.HasSuffix(unit, "cpu-ms/s"):
		return "ms CPU/s"
	case strings.HasSuffix(unit, "-ms"):
		return "ms"
	}
	return unit
}

// format shows rates as whole numbers with thousands separators (digits beyond are noise in a
// benchmark), anything else with one decimal.
func format(v float64, unit string) string {
	if !strings.HasSuffix(unit, "msgs/s") {
		return strconv.FormatFloat(v, 'f', 1, 64)
	}
	s := strconv.FormatFloat(v, 'f', 0, 64)
	var b strings.Builder
	for i, c := range s {
		if i > 0 && (len(s)-i)%3 == 0 {
			b.WriteByte(',')
		}
		b.WriteRune(c)
	}
	return b.String()
}

func orDash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}
