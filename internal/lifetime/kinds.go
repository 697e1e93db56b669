package lifetime

// ChildrenByKind is the number of open children by kind, for example {"allocation": 2}; a new map
// the caller may keep.
func (o *Owner) ChildrenByKind() map[string]int {
	o.kidsMu.Lock()
	defer o.kidsMu.Unlock()
	out := make(map[string]int, len(o.kids))
	for k, n := range o.kids {
		out[k] = n
	}
	return out
}
