package offload

// DrainAttempts lets the tests fail every synchronization of a drain.
const DrainAttempts = drainAttempts
