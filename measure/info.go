package measure

import (
	"fmt"
	"io"
	"strings"

	"github.com/cuvmm/cuvmm/driver"
	"github.com/cuvmm/cuvmm/internal/units"
	"github.com/cuvmm/cuvmm/vmm"
)

// InfoOptions are Info's options.
type InfoOptions struct {
	Env
}

// DeviceInfo is one device in Info's result.
type DeviceInfo struct {
	Ordinal                int    `json:"ordinal"`
	Name                   string `json:"name"`
	UUID                   string `json:"uuid"`
	MemoryBytes            uint64 `json:"memory_bytes"`
	ComputeCapability      string `json:"compute_capability"`
	VMM                    bool   `json:"vmm"`
	PosixFD                bool   `json:"posix_fd"`
	Fabric                 bool   `json:"fabric"`
	GPUDirectRDMA          bool   `json:"gpudirect_rdma"`
	DMABuf                 bool   `json:"dma_buf"`
	Compression            bool   `json:"compression"`
	HostNUMAVMM            bool   `json:"host_numa_vmm"`
	HostNUMAID             int    `json:"host_numa_id"`
	GranularityBytes       uint64 `json:"granularity_bytes"`
	RecommendedGranularity uint64 `json:"recommended_granularity_bytes"`
	HostNUMAGranularity    uint64 `json:"host_numa_granularity_bytes,omitempty"`
}

// InfoResult is what the driver and its devices report.
type InfoResult struct {
	Backend       string       `json:"backend"`
	DriverVersion int          `json:"driver_version"`
	Devices       []DeviceInfo `json:"devices"`
	// PeerAccess[i][j] reports whether device i can access memory on device j.
	PeerAccess [][]bool `json:"peer_access"`
}

// Info reports the driver version, every device's features and granularity, and which devices
// can access which.
func Info(opts InfoOptions) (*InfoResult, error) {
	if err := opts.check(); err != nil {
		return nil, err
	}
	sys := opts.Backend.Sys
	devs, err := sys.Devices()
	if err != nil {
		return nil, err
	}
	res := &InfoResult{Backend: opts.Backend.Name, DriverVersion: sys.DriverVersion()}
	for _, d := range devs {
		di, err := deviceInfo(d)
		if err != nil {
			return nil, err
		}
		res.Devices = append(res.Devices, di)
	}
	res.PeerAccess = make([][]bool, len(devs))
	for i, d := range devs {
		res.PeerAccess[i] = make([]bool, len(devs))
		for j, p := range devs {
			if res.PeerAccess[i][j], err = d.CanAccessPeer(p); err != nil {
				return nil, err
			}
		}
	}
	return res, nil
}

func deviceInfo(d *vmm.Device) (DeviceInfo, error) {
	major, _ := d.Attribute(driver.AttrComputeCapabilityMajor)
	minor, _ := d.Attribute(driver.AttrComputeCapabilityMinor)
	uuid := d.UUID()
	di := DeviceInfo{
		Ordinal: d.Ordinal(), Name: d.Name(), MemoryBytes: d.TotalMemory(),
		UUID:              fmt.Sprintf("%x-%x-%x-%x-%x", uuid[0:4], uuid[4:6], uuid[6:8], uuid[8:10], uuid[10:16]),
		ComputeCapability: fmt.Sprintf("%d.%d", major, minor),
		VMM:               d.Supports(driver.AttrVirtualMemoryManagementSupported),
		PosixFD:           d.Supports(driver.AttrHandleTypePosixFDSupported),
		Fabric:            d.Supports(driver.AttrHandleTypeFabricSupported),
		GPUDirectRDMA:     d.Supports(driver.AttrGPUDirectRDMAWithCUDAVMMSupported),
		DMABuf:            d.Supports(driver.AttrDMABufSupported),
		Compression:       d.Supports(driver.AttrGenericCompressionSupported),
		HostNUMAVMM:       d.Supports(driver.AttrHostNUMAVirtualMemoryManagementSupported),
		HostNUMAID:        d.HostNUMAID(),
	}
	var err error
	if di.GranularityBytes, err = d.DeviceGranularity(); err != nil {
		return di, err
	}
	if di.RecommendedGranularity, err = d.Granularity(d.Location(), driver.GranularityRecommended); err != nil {
		return di, err
	}
	if di.HostNUMAVMM && di.HostNUMAID >= 0 {
		if g, err := d.Granularity(driver.HostNUMALocation(di.HostNUMAID), driver.GranularityMinimum); err == nil {
			di.HostNUMAGranularity = g
		}
	}
	return di, nil
}

// Text writes the result for people.
func (r *InfoResult) Text(w io.Writer) {
	fmt.Fprintf(w, "backend: %s, driver version %d.%d (%d)\n", r.Backend, r.DriverVersion/1000, r.DriverVersion%1000/10, r.DriverVersion)
	for _, d := range r.Devices {
		fmt.Fprintf(w, "device %d: %s, %s, compute %s, uuid %s\n", d.Ordinal, d.Name, units.FormatSize(d.MemoryBytes), d.ComputeCapability, d.UUID)
		fmt.Fprintf(w, "  VMM %s, POSIX FD %s, fabric %s, GPUDirect RDMA %s, dma-buf %s, compression %s, host-NUMA VMM %s (node %d)\n",
			yesNo(d.VMM), yesNo(d.PosixFD), yesNo(d.Fabric), yesNo(d.GPUDirectRDMA), yesNo(d.DMABuf), yesNo(d.Compression), yesNo(d.HostNUMAVMM), d.HostNUMAID)
		fmt.Fprintf(w, "  granularity: device %s (recommended %s)", units.FormatSize(d.GranularityBytes), units.FormatSize(d.RecommendedGranularity))
		if d.HostNUMAGranularity != 0 {
			fmt.Fprintf(w, ", host-NUMA %s", units.FormatSize(d.HostNUMAGranularity))
		}
		fmt.Fprintln(w)
	}
	if len(r.Devices) > 1 {
		fmt.Fprintln(w, "peer access (row can access column):")
		var hdr strings.Builder
		hdr.WriteString("      ")
		for j := range r.Devices {
			fmt.Fprintf(&hdr, " %3d", j)
		}
		fmt.Fprintln(w, hdr.String())
		for i, row := range r.PeerAccess {
			fmt.Fprintf(w, "  %3d ", i)
			for _, ok := range row {
				fmt.Fprintf(w, " %3s", yesNo(ok))
			}
			fmt.Fprintln(w)
		}
	}
}
