package main

import (
	"bytes"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

const sample = `goos: linux
goarch: amd64
pkg: github.com/txbox/txbox/bench
cpu: Test CPU @ 3GHz
BenchmarkRelayDrain/watermill-forwarder-2         	   20000	    349471 ns/op	      2000 msgs/s
--- BENCH: BenchmarkRelayDrain/watermill-forwarder-2
    pgtest.go:82: pgserver: using local cluster
BenchmarkRelayDrain/txbox-transactional-2         	   20000	     82038 ns/op	     12000 msgs/s
BenchmarkRelayDrain/txbox-transactional-2         	   20000	     82038 ns/op	     14000 msgs/s
BenchmarkRelayDrain/txbox-transactional-2         	   20000	     82038 ns/op	     99000 msgs/s
BenchmarkLatency/watermill-forwarder-2         	     200	   6095533 ns/op	         6.312 p50-ms	        22.03 p99-ms
BenchmarkLatency/txbox-2                       	     200	   6804950 ns/op	         7.545 p50-ms	        31.74 p99-ms
PASS
ok  	github.com/txbox/txbox/bench	33.532s
`

func TestTable(t *testing.T) {
	var out bytes.Buffer
	require.NoError(t, run(strings.NewReader(sample), &out))
	require.Equal(t, `CPU: Test CPU @ 3GHz, GOMAXPROCS 2

| benchmark | variant | msgs/s | vs baseline | p50-ms | p99-ms |
|---|---|---:|---:|---:|---:|
| RelayDrain | watermill-forwarder (baseline) | 2,000 | 1.00× |  |  |
|  | txbox-transactional | 14,000 | 7.00× |  |  |
| Latency | watermill-forwarder (baseline) |  |  | 6.3 | 22.0 |
|  | txbox |  |  | 7.5 | 31.7 |
`, out.String())
}

func TestNoResultsIsAnError(t *testing.T) {
	err := run(strings.NewReader("FAIL\tgithub.com/txbox/txbox/bench [build failed]\n"), &bytes.Buffer{})
	require.Error(t, err)
}
