package main

import (
	"github.com/cuvmm/cuvmm/measure"
	"github.com/cuvmm/cuvmm/vmm"
)

// backend and newProgress serve the subcommands not yet moved to package measure.
type backend struct {
	name string
	sys  *vmm.System
	sim  *struct{}
	mb   *measure.Backend
}

func (c *common) openLegacy(e *env) (*backend, error) {
	mb, err := c.open(e)
	if err != nil {
		return nil, err
	}
	b := &backend{name: mb.Name, sys: mb.Sys, mb: mb}
	if mb.Sim() {
		b.sim = &struct{}{}
	}
	return b, nil
}

func (b *backend) Close() error { return b.mb.Close() }

type noBar struct{}

func (noBar) Update(uint64) {}
func (noBar) Done()         {}

func newProgress(e *env, label string, total uint64, jsonOut bool) measure.Bar {
	if !e.interactive || jsonOut || total == 0 {
		return noBar{}
	}
	return e.Begin(label, total)
}

func yesNo(b bool) string {
	if b {
		return "yes"
	}
	return "no"
}
