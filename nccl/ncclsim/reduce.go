package ncclsim

import (
	"math"
	"unsafe"

	"github.com/cuvmm/cuvmm/nccl"
)

type number interface {
	~int8 | ~uint8 | ~int32 | ~uint32 | ~int64 | ~uint64 | ~float32 | ~float64
}

// reduce combines parts (one per rank, in rank order, so every rank computes the same bits) with op.
func reduce(parts [][]byte, t nccl.DataType, op nccl.RedOp) []byte {
	out := make([]byte, len(parts[0]))
	copy(out, parts[0])
	switch t {
	case nccl.Int8:
		reduceAs[int8](out, parts, op)
	case nccl.Uint8:
		reduceAs[uint8](out, parts, op)
	case nccl.Int32:
		reduceAs[int32](out, parts, op)
	case nccl.Uint32:
		reduceAs[uint32](out, parts, op)
	case nccl.Int64:
		reduceAs[int64](out, parts, op)
	case nccl.Uint64:
		reduceAs[uint64](out, parts, op)
	case nccl.Float32:
		reduceAs[float32](out, parts, op)
	case nccl.Float64:
		reduceAs[float64](out, parts, op)
	case nccl.Float16:
		reduceNarrow(out, parts, op, float16)
	case nccl.Bfloat16:
		reduceNarrow(out, parts, op, bfloat16)
	case nccl.Float8e4m3:
		reduceNarrow(out, parts, op, e4m3.format())
	case nccl.Float8e5m2:
		reduceNarrow(out, parts, op, e5m2.format())
	}
	return out
}

func view[T number](b []byte) []T {
	var z T
	if len(b) == 0 {
		return nil
	}
	return unsafe.Slice((*T)(unsafe.Pointer(&b[0])), len(b)/int(unsafe.Sizeof(z)))
}

func reduceAs[T number](out []byte, parts [][]byte, op nccl.RedOp) {
	acc := view[T](out)
	for _, p := range parts[1:] {
		x := view[T](p)
		for i := range acc {
			acc[i] = combine(acc[i], x[i], op)
		}
	}
	if op == nccl.Avg {
		n := T(len(parts))
		for i := range acc {
			acc[i] /= n
		}
	}
}

func combine[T number](a, b T, op nccl.RedOp) T {
	switch op {
	case nccl.Prod:
		return a * b
	case nccl.Max:
		return max(a, b)
	case nccl.Min:
		return min(a, b)
	}
	return a + b // Sum, and Avg before the division
}

// narrow is a floating-point format narrower than float32: its width in bytes (1 or 2, little
// endian) and its conversions from and to float32.
type narrow struct {
	width  int
	to32   func(uint16) float32
	from32 func(float32) uint16
}

var (
	float16  = narrow{2, f16to32, f32to16}
	bfloat16 = narrow{2, bf16to32, f32tobf16}
)

func (f narrow) load(b []byte, i int) float32 {
	if f.width == 1 {
		return f.to32(uint16(b[i]))
	}
	return f.to32(uint16(b[2*i]) | uint16(b[2*i+1])<<8)
}

func (f narrow) store(b []byte, i int, v float32) {
	h := f.from32(v)
	if f.width == 1 {
		b[i] = byte(h)
		return
	}
	b[2*i], b[2*i+1] = byte(h), byte(h>>8)
}

// reduceNarrow reduces elements of format f in float32, rounding the result back once.
func reduceNarrow(out []byte, parts [][]byte, op nccl.RedOp, f narrow) {
	acc := make([]float32, len(out)/f.width)
	for i := range acc {
		acc[i] = f.load(out, i)
	}
	for _, p := range parts[1:] {
		for i := range acc {
			acc[i] = combine(acc[i], f.load(p, i), op)
		}
	}
	for i, v := range acc {
		if op == nccl.Avg {
			v /= float32(len(parts))
		}
		f.store(out, i, v)
	}
}

func bf16to32(h uint16) float32 { return math.Float32frombits(uint32(h) << 16) }

func f32tobf16(f float32) uint16 {
	b := math.Float32bits(f)
	if f != f {
		return uint16(b>>16) | 0x40 // keep NaN a NaN
	}
	return uint16((b + 0x7fff + (b>>16)&1) >> 16) // round to nearest even
}

func f16to32(h uint16) float32 {
	sign := uint32(h>>15) << 31
	exp := int32(h>>10) & 0x1f
	man := uint32(h) & 0x3ff
	switch {
	case exp == 0x1f:
		return math.Float32frombits(sign | 0xff<<23 | man<<13)
	case exp == 0 && man == 0:
		return math.Float32frombits(sign)
	case exp == 0: // subnormal
		f := float32(man) / 1024 / 16384
		if sign != 0 {
			f = -f
		}
		return f
	}
	return math.Float32frombits(sign | uint32(exp-15+127)<<23 | man<<13)
}

func f32to16(f float32) uint16 {
	b := math.Float32bits(f)
	sign := uint16(b>>16) & 0x8000
	if f != f {
		return sign | 0x7e00
	}
	a := math.Abs(float64(f))
	switch {
	case a >= 65520:
		return sign | 0x7c00
	case a < 6.103515625e-05: // subnormal or zero: a multiple of 2^-24
		return sign | uint16(math.RoundToEven(a*16777216))
	}
	exp := int32(b>>23)&0xff - 127 + 15
	man := b & 0x7fffff
	h := uint32(exp)<<10 | man>>13
	rest := man & 0x1fff
	if rest > 0x1000 || (rest == 0x1000 && h&1 == 1) {
		h++ // may carry into the exponent, which is right
	}
	return sign | uint16(h)
}
