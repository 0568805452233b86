package outbox

import (
	"encoding/json"
	"hash/fnv"
	"testing"

	"github.com/stretchr/testify/require"
)

// FuzzAppendMetadata checks the hand-written encoder against encoding/json, which every reader
// decodes the stored metadata with: whatever the text, the readers get the map that was written.
func FuzzAppendMetadata(f *testing.F) {
	for _, s := range []string{"", "plain", `quote " and \ backslash`, "tab\tnewline\n\x01\x1f", "ünïcødé ✓ 😀",
		"<html>&amp;", "\u2028\u2029", "\xff\xfe invalid", "\x00"} {
		f.Add("k", s, "traceparent", "00-x")
		f.Add(s, "v", s, s)
	}
	f.Fuzz(func(t *testing.T, key, value, traceKey, traceValue string) {
		md := map[string]string{key: value, "other": value + key}
		trace := traceFields{traceKey, traceValue}
		var got map[string]string
		require.NoError(t, json.Unmarshal(appendMetadata([]byte("prefix"), md, trace)[len("prefix"):], &got))

		want := map[string]string{}
		for k, v := range md {
			want[k] = v
		}
		want[traceKey] = traceValue // the trace context wins, as a propagator writing into a copy would
		// encoding/json, like the encoder, turns invalid UTF-8 into U+FFFD.
		encoded, err := json.Marshal(want)
		require.NoError(t, err)
		want = nil
		require.NoError(t, json.Unmarshal(encoded, &want))
		require.Equal(t, want, got)
	})
}

func TestAppendMetadataIsDeterministic(t *testing.T) {
	md := map[string]string{"b": "2", "a": "1", "c": "3", "txbox_partition_key": "order-1"}
	want := `{"a":"1","b":"2","c":"3","traceparent":"00-t","txbox_partition_key":"order-1"}`
	for range 20 {
		require.Equal(t, want, string(appendMetadata(nil, md, traceFields{"traceparent", "00-t"})),
			"keys in byte order, whatever the map's iteration order")
	}
	require.Equal(t, `{}`, string(appendMetadata(nil, nil, nil)))
}

func TestTraceFieldsAreACarrier(t *testing.T) {
	var f traceFields
	f.Set("traceparent", "a")
	f.Set("tracestate", "b")
	f.Set("traceparent", "c")
	require.Equal(t, "c", f.Get("traceparent"), "Set replaces, as a map carrier's does")
	require.Equal(t, "", f.Get("baggage"))
	require.Equal(t, []string{"traceparent", "tracestate"}, f.Keys())
}

// Slots are part of the stored format: the written-out hash must stay hash/fnv's FNV-1a.
func FuzzSlotOfIsFNV1a(f *testing.F) {
	for _, s := range []string{"", "order-1", "ünïcødé", "\xff\x00", "a much longer partition key than most"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, key string) {
		h := fnv.New32a()
		h.Write([]byte(key))
		want := int16(h.Sum32() % Slots)
		require.Equal(t, want, SlotOf("", key), "a keyless message by its UUID")
		if key != "" {
			require.Equal(t, want, SlotOf(key, "another uuid"))
		}
	})
}
