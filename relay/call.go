package relay

// CallConfig configures the execution of side-effect calls.
type CallConfig struct{}

func (c *CallConfig) validate() error { return nil }

// runCalls executes the shard's call rows until the lease ends; true means the lease was fenced.
func (l *lease) runCalls() bool { return false }
