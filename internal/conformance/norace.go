//go:build !race

package conformance

// RaceDetector says whether the test binary was built with -race.
const RaceDetector = false
