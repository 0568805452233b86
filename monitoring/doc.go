// Package monitoring holds what an operator loads next to txbox's metrics: Prometheus alerting
// rules (alerts.yml, with promtool unit tests in alerts_test.yml) and a Grafana dashboard
// (dashboard.json). It has no Go API; its tests check that every metric the rules and the
// dashboard name is one txbox exports, with the labels it has, and that the README's metric table
// lists exactly the exported metrics. CI also runs `promtool check rules` and `promtool test rules`.
package monitoring
