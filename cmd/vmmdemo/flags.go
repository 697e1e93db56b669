package main

import (
	"errors"
	"flag"
	"fmt"
	"strconv"
	"strings"
)

// deviceList is a flag.Value: "all" or a comma-separated list of distinct ordinals. An empty value
// is refused (every subcommand's --devices needs at least one device) unless allowEmpty is set
// (stripe's --access-only, whose empty list means none).
type deviceList struct {
	all        bool
	ordinals   []int
	allowEmpty bool
}

func (l *deviceList) String() string {
	if l.all {
		return "all"
	}
	parts := make([]string, len(l.ordinals))
	for i, o := range l.ordinals {
		parts[i] = strconv.Itoa(o)
	}
	return strings.Join(parts, ",")
}

func (l *deviceList) Set(v string) error {
	v = strings.TrimSpace(v)
	l.all, l.ordinals = false, nil
	if v == "all" {
		l.all = true
		return nil
	}
	if v == "" {
		if l.allowEmpty {
			return nil
		}
		return errors.New("no devices given (want a list such as 0,1, or all)")
	}
	seen := map[int]bool{}
	for _, f := range strings.Split(v, ",") {
		o, err := strconv.Atoi(strings.TrimSpace(f))
		if err != nil || o < 0 {
			return fmt.Errorf("%q is not a device ordinal (want a list such as 0,1, or all)", f)
		}
		if seen[o] {
			return fmt.Errorf("device %d is listed twice", o)
		}
		seen[o] = true
		l.ordinals = append(l.ordinals, o)
	}
	return nil
}

// list is the ordinals for package measure: nil for all, an empty list for none given.
func (l *deviceList) list() []int {
	if l.all {
		return nil
	}
	if l.ordinals == nil {
		return []int{}
	}
	return l.ordinals
}

var _ flag.Value = (*deviceList)(nil)
