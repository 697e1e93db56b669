package offload_test

import (
	"os"
	"testing"

	"github.com/cuvmm/cuvmm/internal/testutil"
)

// TestMain adds the leak report of builds with the cuvmmleak tag.
func TestMain(m *testing.M) { os.Exit(testutil.Main(m)) }
