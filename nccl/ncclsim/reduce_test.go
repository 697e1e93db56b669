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

// TestFloat8Conversions: every finite code survives a round trip; values round to the nearest code
// (ties to even) and saturate to the largest finite value, as CUDA's __NV_SATFINITE conversion does.
func TestFloat8Conversions(t *testing.T) {
	for _, f := range []*float8{e4m3, e5m2} {
		for c := range 256 {
			v := f.to32(uint8(c))
			if v != v || math.IsInf(float64(v), 0) {
				continue
			}
			if v == 0 {
				require.Equal(t, uint8(c)&0x80, f.from32(v)&0x80, "the sign of zero code %#x", c)
				continue
			}
			require.Equal(t, uint8(c), f.from32(v), "round trip of code %#x (%v)", c, v)
		}
		require.Equal(t, uint8(0x7f), f.from32(float32(math.NaN()))&0x7f)
		require.Equal(t, f.maxFin, f.from32(float32(math.Inf(1))), "infinity saturates")
		require.Equal(t, 0x80|f.maxFin, f.from32(-1e30), "overflow saturates")
	}
	require.Equal(t, float32(448), e4m3.to32(0x7e))
	require.Equal(t, float32(57344), e5m2.to32(0x7b))
	require.True(t, math.IsInf(float64(e5m2.to32(0x7c)), 1))
	require.Equal(t, float32(0.001953125), e4m3.to32(0x01), "the smallest e4m3 subnormal, 2^-9")
	require.Equal(t, uint8(0x38), e4m3.from32(1.0625), "half way between 1 and 1.125: to even (1)")
	require.Equal(t, uint8(0x3a), e4m3.from32(1.1875), "half way between 1.125 and 1.25: to even (1.25)")
	require.Equal(t, uint8(0x3a), e4m3.from32(1.3125), "half way between 1.25 and 1.375: to even (1.25)")
	require.Equal(t, uint8(0x39), e4m3.from32(1.1), "the nearest code")
}

func TestReduceFloat8(t *testing.T) {
	for _, dt := range []nccl.DataType{nccl.Float8e4m3, nccl.Float8e5m2} {
		f := map[nccl.DataType]*float8{nccl.Float8e4m3: e4m3, nccl.Float8e5m2: e5m2}[dt]
		enc := func(v ...float32) []byte {
			b := make([]byte, len(v))
			for i, x := range v {
				b[i] = f.from32(x)
			}
			return b
		}
		parts := [][]byte{enc(1, 0.5, -3), enc(2, 0.25, 1)}
		require.Equal(t, enc(3, 0.75, -2), reduce(parts, dt, nccl.Sum), "%s", dt)
		require.Equal(t, enc(2, 0.5, 1), reduce(parts, dt, nccl.Max), "%s", dt)
		require.Equal(t, enc(1.5, 0.375, -1), reduce(parts, dt, nccl.Avg), "%s", dt)
		big := f.to32(f.maxFin)
		require.Equal(t, enc(big), reduce([][]byte{enc(big), enc(big)}, dt, nccl.Sum), "%s saturates", dt)
	}
}
