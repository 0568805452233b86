package pgtext

import (
	"fmt"
	"strconv"
	"strings"
)

// Literal returns s as a PostgreSQL escape string constant (E'...'), which reads the same whatever
// standard_conforming_strings is. s must be Valid: a NUL cannot be written in a constant, and in
// UTF-8 no byte of a multi-byte character is a quote or a backslash, so escaping those two suffices.
func Literal(s string) string {
	var b strings.Builder
	b.Grow(len(s) + 3)
	b.WriteString("E'")
	for i := 0; i < len(s); i++ {
		if s[i] == '\'' || s[i] == '\\' {
			b.WriteByte('\\')
		}
		b.WriteByte(s[i])
	}
	b.WriteByte('\'')
	return b.String()
}

// WriteConstants writes args as a comma-separated list of constants, for the parameters of an
// EXECUTE, which takes constants: strings (which must be Valid), integers, booleans, nil (NULL) and
// pointers to them, nil or not.
func WriteConstants(b *strings.Builder, args ...any) error {
	for i, v := range args {
		if i > 0 {
			b.WriteByte(',')
		}
		if err := writeConstant(b, v); err != nil {
			return fmt.Errorf("pgtext: parameter $%d: %w", i+1, err)
		}
	}
	return nil
}

func writeConstant(b *strings.Builder, v any) error {
	switch v := v.(type) {
	case nil:
		b.WriteString("NULL")
	case string:
		if !Valid(v) {
			return fmt.Errorf("%q is not valid PostgreSQL text", v)
		}
		b.WriteString(Literal(v))
	case bool:
		b.WriteString(strconv.FormatBool(v))
	case int:
		writeInt(b, int64(v))
	case int32:
		writeInt(b, int64(v))
	case int64:
		writeInt(b, v)
	case *string:
		return writeConstant(b, deref(v))
	case *int32:
		return writeConstant(b, deref(v))
	case *int64:
		return writeConstant(b, deref(v))
	default:
		return fmt.Errorf("cannot write a %T as a constant", v)
	}
	return nil
}

// writeInt parenthesises a negative number: "x -$1" must not become the comment "x --1".
func writeInt(b *strings.Builder, v int64) {
	if v < 0 {
		b.WriteString("(" + strconv.FormatInt(v, 10) + ")")
		return
	}
	b.WriteString(strconv.FormatInt(v, 10))
}

func deref[T any](p *T) any {
	if p == nil {
		return nil
	}
	return *p
}
