package pinned

// PopulateKnown is populateKnown, for the tests of package pinned_test.
var PopulateKnown = populateKnown
