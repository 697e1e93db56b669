package pinned

// DrainAttempts is how many synchronizations a Stager's drain tries (drainAttempts), for tests that
// make every one of them fail.
const DrainAttempts = drainAttempts
