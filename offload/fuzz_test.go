package offload

import (
	"bytes"
	"errors"
	"testing"
)

// FuzzReadHeader: any bytes give a header or an error wrapping ErrBadCheckpoint, never a panic, and
// a header that reads back writes back to the same bytes.
func FuzzReadHeader(f *testing.F) {
	var good bytes.Buffer
	hdr := ckHeader{Entries: []ckEntry{{Tag: "weights", Policy: "keep", Ptr: 0x7f0000000000, Len: 4 << 20,
		Chunks: []ckChunk{{Offset: 0, Size: 2 << 20, LocationType: 1, Access: []ckAccess{{1, 0, 3}}}, {Offset: 2 << 20, Size: 2 << 20}}}}}
	if err := writeHeader(&good, &hdr); err != nil {
		f.Fatal(err)
	}
	f.Add(good.Bytes())
	f.Add([]byte("CUVMMCKP"))
	f.Add([]byte("CUVMMCKP\x01\x00\x00\x00\xff\xff\xff\xff"))
	f.Add([]byte("not a checkpoint at all"))
	f.Fuzz(func(t *testing.T, b []byte) {
		h, err := readHeader(bytes.NewReader(b))
		if err != nil {
			if !errors.Is(err, ErrBadCheckpoint) {
				t.Fatalf("error %v does not wrap ErrBadCheckpoint", err)
			}
			return
		}
		var again bytes.Buffer
		if err := writeHeader(&again, h); err != nil {
			t.Fatal(err)
		}
		if _, err := readHeader(&again); err != nil {
			t.Fatalf("a header that read back does not read back again: %v", err)
		}
	})
}
