//go:build !txbox_failpoints

package failpoint

// act does nothing: without BuildTag, EnvVar is never read.
func act(string) {}
