package chaos_test

import (
	"testing"

	"github.com/txbox/txbox/internal/pgtest"
)

func TestMain(m *testing.M) { pgtest.Main(m) }
