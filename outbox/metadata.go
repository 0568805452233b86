package outbox

import (
	"context"
	"slices"
	"unicode/utf8"

	"go.opentelemetry.io/otel"
)

// traceFields is the trace context of ctx as the global OpenTelemetry propagator writes it: pairs
// of key and value. It is nil when the propagator writes nothing (none is set, or ctx has no span).
type traceFields []string

func traceFieldsOf(ctx context.Context) traceFields {
	var f traceFields
	otel.GetTextMapPropagator().Inject(ctx, &f)
	return f
}

// Get, Set and Keys make traceFields a propagation.TextMapCarrier. Set replaces, as a map would.
func (f *traceFields) Get(key string) string {
	if i := f.index(key); i >= 0 {
		return (*f)[i+1]
	}
	return ""
}

func (f *traceFields) Set(key, value string) {
	if i := f.index(key); i >= 0 {
		(*f)[i+1] = value
		return
	}
	*f = append(*f, key, value)
}

func (f *traceFields) Keys() []string {
	keys := make([]string, 0, len(*f)/2)
	for i := 0; i < len(*f); i += 2 {
		keys = append(keys, (*f)[i])
	}
	return keys
}

func (f traceFields) index(key string) int {
	for i := 0; i < len(f); i += 2 {
		if f[i] == key {
			return i
		}
	}
	return -1
}

// appendMetadata appends md with the trace fields as a JSON object, the stored form of a row's
// metadata, with keys in byte order. A trace field replaces a metadata key of the same name. It is
// the outbox's hot path, hence no map copy and no encoding/json: the readers (the relay, Admin,
// the CLI and console) decode it with encoding/json.
func appendMetadata(buf []byte, md map[string]string, trace traceFields) []byte {
	var stack [8]string
	keys := stack[:0]
	for k := range md {
		if trace.index(k) < 0 {
			keys = append(keys, k)
		}
	}
	for i := 0; i < len(trace); i += 2 {
		keys = append(keys, trace[i])
	}
	slices.Sort(keys)
	buf = append(buf, '{')
	for i, k := range keys {
		if i > 0 {
			buf = append(buf, ',')
		}
		v, traced := md[k], trace.index(k)
		if traced >= 0 {
			v = trace[traced+1]
		}
		buf = appendJSONString(buf, k)
		buf = append(buf, ':')
		buf = appendJSONString(buf, v)
	}
	return append(buf, '}')
}

const hex = "0123456789abcdef"

// appendJSONString appends s as a JSON string. Invalid UTF-8 becomes U+FFFD, as encoding/json
// does; Publish refuses it in metadata anyway, but a propagator's fields are not checked.
func appendJSONString(buf []byte, s string) []byte {
	buf = append(buf, '"')
	start := 0
	for i := 0; i < len(s); {
		c := s[i]
		if c >= 0x20 && c != '"' && c != '\\' && c < utf8.RuneSelf {
			i++
			continue
		}
		if c >= utf8.RuneSelf {
			r, size := utf8.DecodeRuneInString(s[i:])
			if r != utf8.RuneError || size != 1 {
				i += size
				continue
			}
		}
		buf = append(buf, s[start:i]...)
		switch {
		case c == '"', c == '\\':
			buf = append(buf, '\\', c)
		case c < 0x20:
			buf = append(buf, '\\', 'u', '0', '0', hex[c>>4], hex[c&0xf])
		default:
			buf = append(buf, `\ufffd`...)
		}
		i++
		start = i
	}
	buf = append(buf, s[start:]...)
	return append(buf, '"')
}
