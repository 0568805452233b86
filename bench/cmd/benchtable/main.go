// Benchtable reads `go test -bench` output on standard input and prints a Markdown table with one
// row per variant: each benchmark's last name element is its variant, and the first variant of a
// benchmark is the baseline the others are compared with.
//
//	go test -run '^$' -bench . ./bench/ | go run ./bench/cmd/benchtable
//
// Results of a name seen more than once (-count) are summarised by their median.
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

// rateUnit is the throughput metric the benchmarks report and the one compared with the baseline.
const rateUnit = "msgs/s"

// builtin metrics say nothing about a pipeline's speed here: an op is one message or one drain.
var builtin = map[string]bool{"ns/op": true, "B/op": true, "allocs/op": true, "MB/s": true}

var (
	resultLine = regexp.MustCompile(`^Benchmark(\S+?)(?:-(\d+))?\s+(\d+)\s+(.*)$`)
	cpuLine    = regexp.MustCompile(`^cpu:\s*(.*?)\s*$`)
)

type variant struct {
	name    string
	metrics map[string][]float64
}

type group struct {
	name     string
	variants []*variant
}

type results struct {
	groups []*group
	units  []string // custom units besides rateUnit, in order of first appearance
	cpu    string
	procs  string
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
		full, procs, rest := m[1], m[2], m[4]
		if procs != "" {
			res.procs = procs
		}
		gname, vname := full, ""
		if i := strings.LastIndex(full, "/"); i >= 0 {
			gname, vname = full[:i], full[i+1:]
		}
		v := res.variant(gname, vname)
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
			if unit != rateUnit && !slices.Contains(res.units, unit) {
				res.units = append(res.units, unit)
			}
			v.metrics[unit] = append(v.metrics[unit], val)
		}
	}
	if err := sc.Err(); err != nil {
		return nil, err
	}
	if len(res.groups) == 0 {
		return nil, errors.New("no benchmark results in the input")
	}
	return res, nil
}

func (res *results) variant(gname, vname string) *variant {
	i := slices.IndexFunc(res.groups, func(g *group) bool { return g.name == gname })
	if i < 0 {
		res.groups = append(res.groups, &group{name: gname})
		i = len(res.groups) - 1
	}
	g := res.groups[i]
	j := slices.IndexFunc(g.variants, func(v *variant) bool { return v.name == vname })
	if j < 0 {
		g.variants = append(g.variants, &variant{name: vname, metrics: map[string][]float64{}})
		j = len(g.variants) - 1
	}
	return g.variants[j]
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
	header := []string{"benchmark", "variant", rateUnit, "vs baseline"}
	align := []string{"---", "---", "---:", "---:"}
	for _, u := range res.units {
		header = append(header, u)
		align = append(align, "---:")
	}
	fmt.Fprintf(out, "| %s |\n|%s|\n", strings.Join(header, " | "), strings.Join(align, "|"))
	for _, g := range res.groups {
		base, hasBase := median(g.variants[0].metrics[rateUnit])
		for i, v := range g.variants {
			name := v.name
			if i == 0 && len(g.variants) > 1 {
				name += " (baseline)"
			}
			gname := g.name
			if i > 0 {
				gname = ""
			}
			row := []string{gname, name, "", ""}
			if rate, ok := median(v.metrics[rateUnit]); ok {
				row[2] = thousands(rate)
				if hasBase && base > 0 && len(g.variants) > 1 {
					row[3] = fmt.Sprintf("%.2f×", rate/base)
				}
			}
			for _, u := range res.units {
				cell := ""
				if val, ok := median(v.metrics[u]); ok {
					cell = strconv.FormatFloat(val, 'f', 1, 64)
				}
				row = append(row, cell)
			}
			fmt.Fprintf(out, "| %s |\n", strings.Join(row, " | "))
		}
	}
}

// thousands formats a rate as a whole number with thousands separators: digits beyond that are
// noise in a benchmark.
func thousands(v float64) string {
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
