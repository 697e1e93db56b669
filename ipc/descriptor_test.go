package ipc_test

import (
	"encoding/binary"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/cuvmm/cuvmm/driver"
	"github.com/cuvmm/cuvmm/ipc"
)

func sampleDescriptor() ipc.Descriptor {
	return ipc.Descriptor{Name: "weights", Size: 10 * mib, Len: 9 * mib, Chunks: []ipc.ChunkDesc{
		{Offset: 0, Size: 2 * mib, Location: driver.DeviceLocation(0), HandleType: driver.HandleTypePosixFD},
		{Offset: 2 * mib, Size: 4 * mib, Location: driver.DeviceLocation(1), HandleType: driver.HandleTypePosixFD},
		{Offset: 8 * mib, Size: 2 * mib, Location: driver.HostNUMALocation(0), HandleType: driver.HandleTypePosixFD},
	}}
}

func TestDescriptorRoundTrip(t *testing.T) {
	d := sampleDescriptor()
	b, err := d.MarshalBinary()
	require.NoError(t, err)
	require.Len(t, b, 32+len("weights")+32*3)
	var got ipc.Descriptor
	require.NoError(t, got.UnmarshalBinary(b))
	require.Equal(t, d, got)
	require.Equal(t, "buffer weights of 10 MiB in 3 chunks", got.String())

	d.Name = ""
	b, err = d.MarshalBinary()
	require.NoError(t, err)
	require.NoError(t, got.UnmarshalBinary(b))
	require.Equal(t, d, got)
}

// A version 1 descriptor (no length in use) still decodes, its length being its size.
func TestDescriptorVersion1(t *testing.T) {
	d := sampleDescriptor()
	b, err := d.MarshalBinary()
	require.NoError(t, err)
	v1 := append([]byte(nil), b[:24]...)
	binary.LittleEndian.PutUint16(v1[4:], 1)
	v1 = append(v1, b[32:]...)
	var got ipc.Descriptor
	require.NoError(t, got.UnmarshalBinary(v1))
	d.Len = d.Size
	require.Equal(t, d, got)
}

func TestDescriptorBadInput(t *testing.T) {
	sample := sampleDescriptor()
	good, err := sample.MarshalBinary()
	require.NoError(t, err)
	mutate := func(f func(b []byte) []byte) []byte { return f(append([]byte(nil), good...)) }
	chunk := func(i int) int { return 32 + len("weights") + 32*i }
	cases := []struct {
		name     string
		data     []byte
		contains string
	}{
		{"empty", nil, "shorter than"},
		{"wrong magic", mutate(func(b []byte) []byte { b[0] = 'X'; return b }), "magic"},
		{"wrong version", mutate(func(b []byte) []byte { binary.LittleEndian.PutUint16(b[4:], 9); return b }), "version 9"},
		{"flags", mutate(func(b []byte) []byte { b[6] = 1; return b }), "flags"},
		{"reserved", mutate(func(b []byte) []byte { b[22] = 1; return b }), "reserved"},
		{"truncated", good[:len(good)-1], "want"},
		{"trailing bytes", append(append([]byte(nil), good...), 0), "want"},
		{"more chunks announced", mutate(func(b []byte) []byte { binary.LittleEndian.PutUint32(b[16:], 4); return b }), "of 4 chunks"},
		{"no chunks", mutate(func(b []byte) []byte {
			binary.LittleEndian.PutUint32(b[16:], 0)
			return b[:32+len("weights")]
		}), "without chunks"},
		{"too many chunks", mutate(func(b []byte) []byte { binary.LittleEndian.PutUint32(b[16:], ipc.MaxChunks+1); return b }), "limit"},
		{"size 0", mutate(func(b []byte) []byte { binary.LittleEndian.PutUint64(b[8:], 0); return b }), "size 0"},
		{"chunk past the end", mutate(func(b []byte) []byte { binary.LittleEndian.PutUint64(b[8:], 9*mib); return b }), "runs past"},
		{"overlapping chunks", mutate(func(b []byte) []byte { binary.LittleEndian.PutUint64(b[chunk(1):], mib); return b }), "overlaps"},
		{"unaligned chunk", mutate(func(b []byte) []byte { binary.LittleEndian.PutUint64(b[chunk(2):], 8*mib+1); return b }), "multiples of 4 KiB"},
		{"empty chunk", mutate(func(b []byte) []byte { binary.LittleEndian.PutUint64(b[chunk(0)+8:], 0); return b }), "non-zero"},
		{"offset overflow", mutate(func(b []byte) []byte {
			binary.LittleEndian.PutUint64(b[chunk(2):], ^uint64(0)-4095)
			return b
		}), "runs past"},
		{"host location", mutate(func(b []byte) []byte { binary.LittleEndian.PutUint32(b[chunk(0)+16:], 2); return b }), "neither a device"},
		{"negative device", mutate(func(b []byte) []byte { binary.LittleEndian.PutUint32(b[chunk(0)+20:], 0xffffffff); return b }), "negative"},
		{"fabric handle", mutate(func(b []byte) []byte { binary.LittleEndian.PutUint32(b[chunk(0)+24:], 8); return b }), "handle type fabric"},
		{"chunk reserved", mutate(func(b []byte) []byte { b[chunk(1)+28] = 1; return b }), "reserved"},
		{"name with a control character", mutate(func(b []byte) []byte { b[32] = '\n'; return b }), "control character"},
		{"name not UTF-8", mutate(func(b []byte) []byte { b[32] = 0xff; return b }), "not UTF-8"},
		{"length above the size", mutate(func(b []byte) []byte { binary.LittleEndian.PutUint64(b[24:], 11*mib); return b }), "length in use"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			d := sampleDescriptor()
			err := d.UnmarshalBinary(tc.data)
			require.ErrorIs(t, err, ipc.ErrProtocol)
			require.ErrorContains(t, err, tc.contains)
			require.Equal(t, sampleDescriptor(), d, "a failed decode leaves the descriptor unchanged")
		})
	}

	// MarshalBinary validates too.
	d := sampleDescriptor()
	d.Name = strings.Repeat("n", ipc.MaxNameLen+1)
	_, err = d.MarshalBinary()
	require.ErrorIs(t, err, ipc.ErrTooLarge)
	d = sampleDescriptor()
	d.Chunks[1].HandleType = driver.HandleTypeFabric | driver.HandleTypePosixFD
	_, err = d.MarshalBinary()
	require.ErrorIs(t, err, ipc.ErrProtocol)
}
