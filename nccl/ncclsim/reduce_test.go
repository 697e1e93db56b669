package ncclsim

import (
	"encoding/binary"
	"math"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/cuvmm/cuvmm/nccl"
)

func TestHalfConversions(t *testing.T) {
	for _, f := range []float32{0, 1, -2.5, 0.333251953125, 65504, 6.1035156e-05, 5.9604645e-08} {
		require.Equal(t, f, f16to32(f32to16(f)), "float16 round trip of %v", f)
	}
	require.True(t, math.IsInf(float64(f16to32(f32to16(1e6))), 1))
	require.True(t, f16to32(f32to16(float32(math.NaN()))) != f16to32(f32to16(float32(math.NaN()))))
	for _, f := range []float32{0, 1, -3, 256, 1.5} {
		require.Equal(t, f, bf16to32(f32tobf16(f)), "bfloat16 round trip of %v", f)
	}
	require.Equal(t, float32(1), bf16to32(f32tobf16(1.001)), "rounded to the nearest bfloat16")
}

func TestReduce(t *testing.T) {
	i32 := func(v ...int32) []byte {
		b := make([]byte, 4*len(v))
		for i, x := range v {
			binary.LittleEndian.PutUint32(b[4*i:], uint32(x))
		}
		return b
	}
	parts := [][]byte{i32(1, -5, 7), i32(3, 2, 7), i32(-2, 9, 1)}
	require.Equal(t, i32(2, 6, 15), reduce(parts, nccl.Int32, nccl.Sum))
	require.Equal(t, i32(-6, -90, 49), reduce(parts, nccl.Int32, nccl.Prod))
	require.Equal(t, i32(3, 9, 7), reduce(parts, nccl.Int32, nccl.Max))
	require.Equal(t, i32(-2, -5, 1), reduce(parts, nccl.Int32, nccl.Min))
	require.Equal(t, i32(0, 2, 5), reduce(parts, nccl.Int32, nccl.Avg))

	h := func(v ...float32) []byte {
		b := make([]byte, 2*len(v))
		for i, x := range v {
			binary.LittleEndian.PutUint16(b[2*i:], f32to16(x))
		}
		return b
	}
	require.Equal(t, h(3, 0.75), reduce([][]byte{h(1, 0.5), h(2, 0.25)}, nccl.Float16, nccl.Sum))
	require.Equal(t, h(1.5, 0.375), reduce([][]byte{h(1, 0.5), h(2, 0.25)}, nccl.Float16, nccl.Avg))
}
