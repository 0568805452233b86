package outbox_test

import (
	"sync"
	"testing"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/propagation"
)

// The OpenTelemetry propagator is process-global; tests that set it take turns.
var propagatorMu sync.Mutex

func withPropagator(t *testing.T, p propagation.TextMapPropagator) {
	propagatorMu.Lock()
	prev := otel.GetTextMapPropagator()
	otel.SetTextMapPropagator(p)
	t.Cleanup(func() {
		otel.SetTextMapPropagator(prev)
		propagatorMu.Unlock()
	})
}
