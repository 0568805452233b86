package console

import "golang.org/x/time/rate"

// SetSignInLimit replaces the sign-in limit, so that a test of it does not depend on how fast
// the machine runs.
func SetSignInLimit(s *Server, every rate.Limit, burst int) {
	s.signIns = rate.NewLimiter(every, burst)
}
