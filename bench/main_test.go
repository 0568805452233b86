package bench

import (
	"testing"

	"github.com/txbox/txbox/internal/pgtest"
)

func TestMain(m *testing.M) { pgtest.Main(m) }
