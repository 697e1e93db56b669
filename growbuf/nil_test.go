package growbuf_test

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/cuvmm/cuvmm/growbuf"
)

// A nil growable buffer reads as empty, as a closed one does, instead of panicking.
func TestNilGrowbufReadsEmpty(t *testing.T) {
	var buf *growbuf.Buffer
	require.Zero(t, buf.Ptr())
	require.Zero(t, buf.Len()+buf.Cap()+buf.Reserved())
	require.Nil(t, buf.Chunks())
	require.Zero(t, buf.Reservations())
	require.Equal(t, "nil growable buffer", buf.String())
}
