//go:build !race

package conformance_test

// raceDetector says whether the test binary was built with -race.
const raceDetector = false
