package idemkey

import (
	"fmt"
	"go/ast"
	"go/types"
	"maps"
	"slices"
)

// sinkKind says what a call sends and so which value must carry the key.
type sinkKind int

const (
	sinkDirect  sinkKind = iota // http.Post & co.: no request to put a header on
	sinkRequest                 // sends an *http.Request (Client.Do, RoundTrip)
	sinkStripe                  // a mutating stripe-go call with a params struct
)

// sink describes the call that finally hits the network.
type sink struct {
	kind sinkKind
	what string // how the call is named in diagnostics
}

// callSink is one way a call expression sends something: either directly,
// or by handing arg to a sink (possibly through same-package helpers).
type callSink struct {
	sink
	arg    ast.Expr // the request or params argument; nil for sinkDirect
	helper string   // the same-package helper called, "" for a direct sink
}

// summary is what callers need to know about a same-package function.
type summary struct {
	setsKey map[int]bool // parameter indexes on which it sets the key
	sends   map[int]sink // parameter indexes it sends without setting the key
}

// sinksOf returns the ways call may send a non-idempotent request.
func sinksOf(info *types.Info, helpers map[*types.Func]*summary, call *ast.CallExpr) []callSink {
	fn := callee(info, call)
	if fn == nil {
		return nil
	}
	_, args := recvAndArgs(info, call)
	switch {
	case isPkgFunc(fn, httpPkg, "Post"), isPkgFunc(fn, httpPkg, "PostForm"):
		return []callSink{{sink: sink{kind: sinkDirect, what: "http." + fn.Name()}}}
	case isMethod(fn, httpPkg, "Client", "Post"), isMethod(fn, httpPkg, "Client", "PostForm"):
		return []callSink{{sink: sink{kind: sinkDirect, what: "(*http.Client)." + fn.Name()}}}
	case isMethod(fn, httpPkg, "Client", "Do"):
		return requestSink("(*http.Client).Do", args)
	case isMethod(fn, httpPkg, "Transport", "RoundTrip"):
		return requestSink("(*http.Transport).RoundTrip", args)
	case isMethod(fn, httpPkg, "RoundTripper", "RoundTrip"):
		return requestSink("(http.RoundTripper).RoundTrip", args)
	case isDoer(fn):
		// Consumers often depend on an interface { Do(*http.Request) ... }
		// so tests can fake the client; the request is sent all the same.
		return requestSink(types.ExprString(call.Fun), args)
	case fn.Pkg() != nil && isStripePath(fn.Pkg().Path()):
		return stripeSink(info, fn, call, args)
	}
	s := helpers[fn]
	if s == nil {
		return nil
	}
	var out []callSink
	for _, i := range sortedKeys(s.sends) {
		if i < len(args) {
			out = append(out, callSink{sink: s.sends[i], arg: args[i], helper: types.ExprString(call.Fun)})
		}
	}
	return out
}

func requestSink(what string, args []ast.Expr) []callSink {
	if len(args) == 0 {
		return nil
	}
	return []callSink{{sink: sink{kind: sinkRequest, what: what}, arg: args[0]}}
}

// isDoer matches methods shaped like (*http.Client).Do on any other type,
// typically an interface: Do(*http.Request) (*http.Response, error).
func isDoer(fn *types.Func) bool {
	sig := fn.Signature()
	if fn.Name() != "Do" || sig.Recv() == nil || sig.Params().Len() != 1 || sig.Results().Len() != 2 {
		return false
	}
	p, ok := types.Unalias(sig.Params().At(0).Type()).(*types.Pointer)
	return ok && isRequest(p) && isNamed(sig.Results().At(0).Type(), httpPkg, "Response") &&
		types.Identical(sig.Results().At(1).Type(), errorType)
}

// stripeSink recognises mutating stripe-go API calls, package functions
// (charge.New) and methods (sc.V1Charges.Create) alike, and picks out
// their params argument.
func stripeSink(info *types.Info, fn *types.Func, call *ast.CallExpr, args []ast.Expr) []callSink {
	if fn.Name() == "RawRequest" {
		// RawRequest(method, path, content, params): mutating only if the
		// method is a constant write.
		if len(args) == 0 {
			return nil
		}
		if m, ok := constString(info, args[0]); !ok || !mutatingMethod(m) {
			return nil
		}
	} else if !isStripeMutating(fn.Name()) {
		return nil
	}
	params := fn.Signature().Params()
	for i := range min(params.Len(), len(args)) {
		if isStripeParams(params.At(i).Type()) {
			what := "stripe call " + types.ExprString(call.Fun)
			return []callSink{{sink: sink{kind: sinkStripe, what: what}, arg: args[i]}}
		}
	}
	return nil
}

// verdict is what a callSink means in the function that contains it.
type verdict struct {
	report bool
	desc   string // for report: how to name the call in the diagnostic
	param  int    // for fwd: the index of the parameter that is sent
	fwd    bool   // the sent value is a parameter: the caller decides
}

// judge decides whether a call sink sends a value that is provably
// non-idempotent and keyless, forwards one of the function's parameters
// (so the decision moves to the callers), or is fine/unknown.
func judge(f *facts, cs callSink) verdict {
	switch cs.kind {
	case sinkDirect:
		return verdict{report: true, desc: cs.what}
	case sinkRequest:
		v := f.resolve(cs.arg)
		if v == nil {
			return verdict{}
		}
		val := f.val(v)
		if val.keySet {
			return verdict{}
		}
		if m, ok := val.httpMethod(); ok {
			if cs.helper != "" {
				return verdict{report: true, desc: fmt.Sprintf("%s (passing a %s request to %s)", cs.helper, m, cs.what)}
			}
			return verdict{report: true, desc: fmt.Sprintf("%s of a %s request", cs.what, m)}
		}
		if i, ok := val.paramIndex(); ok {
			return verdict{fwd: true, param: i}
		}
	case sinkStripe:
		desc := cs.what
		if cs.helper != "" {
			desc = fmt.Sprintf("%s (passing its params to %s)", cs.helper, cs.what)
		}
		if built, key := f.stripeBuilt(cs.arg); built {
			return verdict{report: !key, desc: desc}
		}
		v := f.resolve(cs.arg)
		if v == nil {
			return verdict{}
		}
		val := f.val(v)
		if val.keySet {
			return verdict{}
		}
		if val.stripeBuiltHere() {
			return verdict{report: true, desc: desc}
		}
		if i, ok := val.paramIndex(); ok {
			return verdict{fwd: true, param: i}
		}
	}
	return verdict{}
}

// computeSummaries builds the per-function summaries to a fixed point.
// Key setters come first: they only grow, and whether a function sends a
// keyless parameter depends on them (a helper that sets the key before
// sending is not a sink), so sinks are computed afterwards against final
// facts, where they too only grow.
func (c *checker) computeSummaries() {
	for _, u := range c.units {
		if u.fn != nil {
			c.helpers[u.fn] = &summary{setsKey: map[int]bool{}, sends: map[int]sink{}}
		}
	}
	for changed := true; changed; {
		changed = false
		for _, u := range c.units {
			u.facts = collectFacts(c.pass.TypesInfo, u, c.helpers)
			if u.fn == nil {
				continue
			}
			s := c.helpers[u.fn]
			params := u.fn.Signature().Params()
			for i := range params.Len() {
				p := params.At(i)
				if tracked(p.Type()) && u.facts.val(p).keySet && !s.setsKey[i] {
					s.setsKey[i] = true
					changed = true
				}
			}
		}
	}
	for changed := true; changed; {
		changed = false
		for _, u := range c.units {
			if u.fn == nil {
				continue
			}
			s := c.helpers[u.fn]
			ast.Inspect(u.body, func(n ast.Node) bool {
				call, ok := n.(*ast.CallExpr)
				if !ok {
					return true
				}
				for _, cs := range sinksOf(c.pass.TypesInfo, c.helpers, call) {
					if v := judge(u.facts, cs); v.fwd {
						if _, seen := s.sends[v.param]; !seen {
							s.sends[v.param] = cs.sink
							changed = true
						}
					}
				}
				return true
			})
		}
	}
}

// sortedKeys keeps diagnostics deterministic when a helper sends several
// of its parameters.
func sortedKeys(m map[int]sink) []int { return slices.Sorted(maps.Keys(m)) }
