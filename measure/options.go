package measure

import "fmt"

// intOption is an integer option under the name of the vmmdemo flag that sets it.
type intOption struct {
	flag string
	v    int
}

// atLeast refuses the first of opts below least, naming its flag and value.
func atLeast(least int, opts ...intOption) error {
	for _, o := range opts {
		if o.v < least {
			return fmt.Errorf("--%s %d: want at least %d: %w", o.flag, o.v, least, ErrInvalidOption)
		}
	}
	return nil
}

// nonZeroSize refuses a size of 0, naming its flag.
func nonZeroSize(flag string, v uint64) error {
	if v == 0 {
		return fmt.Errorf("--%s 0: want a size above 0: %w", flag, ErrInvalidOption)
	}
	return nil
}

// firstErr is the first error that is not nil.
func firstErr(errs ...error) error {
	for _, err := range errs {
		if err != nil {
			return err
		}
	}
	return nil
}
