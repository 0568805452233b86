package idemkey

import (
	"go/ast"
	"go/token"
	"go/types"
	"strings"
)

// originKind says where a tracked value (a request, its header map or a
// stripe params struct) came from. Only values whose every origin is
// visible in the function are ever reported: "unknown" anywhere means the
// analyzer stays quiet, because guessing is what produces false positives.
type originKind int

const (
	originUnknown originKind = iota // result of a call, a field, a range variable...
	originRequest                   // http.NewRequest(WithContext) or an http.Request literal
	originStripe                    // a stripe params struct built here (literal, new, zero value, nil)
	originParam                     // a parameter of the enclosing function declaration
)

type origin struct {
	kind   originKind
	method string // originRequest: the HTTP method, "" if not a constant
	param  int    // originParam: parameter index
}

// value is everything known about one tracked value. Variables that alias
// the same request (r2 := r.WithContext(ctx), h := r.Header) share one.
type value struct {
	origins []origin
	// keySet is true once anything in the function sets, or might set, the
	// idempotency key on the value. It is flow-insensitive on purpose: a key
	// set after the call in source order is almost always set on a retry
	// path or a loop, and reporting that would be noise.
	keySet bool
}

// httpMethod returns the mutating method of a request whose method is
// known for every way it was built, or ok=false.
func (v *value) httpMethod() (method string, ok bool) {
	if len(v.origins) == 0 {
		return "", false
	}
	for _, o := range v.origins {
		if o.kind != originRequest || o.method == "" {
			return "", false
		}
		if method == "" && mutatingMethod(o.method) {
			method = strings.ToUpper(o.method)
		}
	}
	return method, method != ""
}

// stripeBuiltHere reports whether a stripe params value was built in this
// function on every path that reaches the call.
func (v *value) stripeBuiltHere() bool {
	if len(v.origins) == 0 {
		return false
	}
	for _, o := range v.origins {
		if o.kind != originStripe {
			return false
		}
	}
	return true
}

// paramIndex returns i if the value is exactly the i-th parameter of the
// enclosing function, which lets the caller decide at its call site.
func (v *value) paramIndex() (int, bool) {
	if len(v.origins) != 1 || v.origins[0].kind != originParam {
		return 0, false
	}
	return v.origins[0].param, true
}

// facts holds the tracked values of one unit (a function declaration with
// every closure nested in it). Closures share their parent's facts because
// "set the header, then retry(func() { client.Do(req) })" is the common
// shape, and the closure alone would not show the header.
type facts struct {
	info    *types.Info
	helpers map[*types.Func]*summary
	parent  map[*types.Var]*types.Var // union-find over aliases
	vals    map[*types.Var]*value
}

func (f *facts) find(v *types.Var) *types.Var {
	for {
		p, ok := f.parent[v]
		if !ok {
			return v
		}
		v = p
	}
}

func (f *facts) val(v *types.Var) *value {
	v = f.find(v)
	if f.vals[v] == nil {
		f.vals[v] = &value{}
	}
	return f.vals[v]
}

func (f *facts) union(a, b *types.Var) {
	ra, rb := f.find(a), f.find(b)
	if ra == rb {
		return
	}
	f.parent[ra] = rb
	if va := f.vals[ra]; va != nil {
		vb := f.val(rb)
		vb.origins = append(vb.origins, va.origins...)
		vb.keySet = vb.keySet || va.keySet
		delete(f.vals, ra)
	}
}

// resolve maps an expression to the tracked variable it denotes, seeing
// through the ways code usually reaches the same request or params:
// &x, *x, req.Header, params.Params, req.WithContext(ctx), req.Clone(ctx).
// It returns nil for anything else, e.g. struct fields (s.req) whose
// writes may happen in other functions.
func (f *facts) resolve(e ast.Expr) *types.Var {
	switch e := ast.Unparen(e).(type) {
	case *ast.Ident:
		v, ok := f.info.ObjectOf(e).(*types.Var)
		if !ok || v.IsField() || !tracked(v.Type()) {
			return nil
		}
		return f.find(v)
	case *ast.StarExpr:
		return f.resolve(e.X)
	case *ast.UnaryExpr:
		if e.Op == token.AND {
			return f.resolve(e.X)
		}
	case *ast.SelectorExpr:
		sel := f.info.Selections[e]
		if sel == nil || sel.Kind() != types.FieldVal {
			return nil
		}
		field := sel.Obj().(*types.Var)
		if (field.Name() == "Header" && isRequest(sel.Recv())) ||
			(field.Embedded() && isStripeParams(field.Type())) {
			return f.resolve(e.X)
		}
	case *ast.CallExpr:
		// WithContext and Clone return the same request (Clone deep-copies
		// the headers already set), so the method and key carry over.
		fn := callee(f.info, e)
		if isMethod(fn, httpPkg, "Request", "WithContext") || isMethod(fn, httpPkg, "Request", "Clone") {
			if recv, _ := recvAndArgs(f.info, e); recv != nil {
				return f.resolve(recv)
			}
		}
	}
	return nil
}

// collectFacts walks a unit once and records where each tracked value
// comes from and whether an idempotency key is set on it.
func collectFacts(info *types.Info, u *unit, helpers map[*types.Func]*summary) *facts {
	f := &facts{
		info:    info,
		helpers: helpers,
		parent:  make(map[*types.Var]*types.Var),
		vals:    make(map[*types.Var]*value),
	}
	if u.fn != nil {
		params := u.fn.Signature().Params()
		for i := range params.Len() {
			if p := params.At(i); tracked(p.Type()) {
				f.val(p).origins = append(f.val(p).origins, origin{kind: originParam, param: i})
			}
		}
	}
	ast.Inspect(u.body, func(n ast.Node) bool {
		switch n := n.(type) {
		case *ast.AssignStmt:
			f.assignStmt(n.Lhs, n.Rhs)
		case *ast.ValueSpec:
			f.valueSpec(n)
		case *ast.RangeStmt:
			for _, e := range []ast.Expr{n.Key, n.Value} {
				if id, ok := e.(*ast.Ident); ok {
					f.bindUnknown(id)
				}
			}
		case *ast.CallExpr:
			f.call(n)
		}
		return true
	})
	return f
}

func (f *facts) assignStmt(lhs, rhs []ast.Expr) {
	if len(lhs) == len(rhs) {
		for i := range lhs {
			f.assign(lhs[i], rhs[i])
		}
		return
	}
	if len(rhs) != 1 {
		return
	}
	// req, err := http.NewRequest(method, url, body)
	if call, ok := ast.Unparen(rhs[0]).(*ast.CallExpr); ok && len(lhs) > 0 {
		if method, ok := f.newRequestMethod(call); ok {
			if id, ok := lhs[0].(*ast.Ident); ok {
				if v := f.varOf(id); v != nil {
					f.val(v).origins = append(f.val(v).origins, origin{kind: originRequest, method: method})
				}
			}
			return
		}
	}
	for _, l := range lhs {
		if id, ok := l.(*ast.Ident); ok {
			f.bindUnknown(id)
		}
	}
}

func (f *facts) valueSpec(spec *ast.ValueSpec) {
	if len(spec.Values) == 0 {
		// var p stripe.ChargeParams / var p *stripe.ChargeParams: a zero
		// value or nil, built here and without a key.
		for _, id := range spec.Names {
			if v := f.varOf(id); v != nil && isStripeParams(v.Type()) {
				f.val(v).origins = append(f.val(v).origins, origin{kind: originStripe})
			}
		}
		return
	}
	lhs := make([]ast.Expr, len(spec.Names))
	for i, id := range spec.Names {
		lhs[i] = id
	}
	f.assignStmt(lhs, spec.Values)
}

// newRequestMethod recognises http.NewRequest and NewRequestWithContext
// and returns their method argument ("" if it is not a constant).
func (f *facts) newRequestMethod(call *ast.CallExpr) (string, bool) {
	fn := callee(f.info, call)
	var arg int
	switch {
	case isPkgFunc(fn, httpPkg, "NewRequest"):
		arg = 0
	case isPkgFunc(fn, httpPkg, "NewRequestWithContext"):
		arg = 1
	default:
		return "", false
	}
	if len(call.Args) <= arg {
		return "", true
	}
	m, _ := constString(f.info, call.Args[arg])
	return m, true
}

func (f *facts) varOf(id *ast.Ident) *types.Var {
	if id.Name == "_" {
		return nil
	}
	v, ok := f.info.ObjectOf(id).(*types.Var)
	if !ok || v.IsField() || !tracked(v.Type()) {
		return nil
	}
	return v
}

func (f *facts) bindUnknown(id *ast.Ident) {
	if v := f.varOf(id); v != nil {
		f.val(v).origins = append(f.val(v).origins, origin{kind: originUnknown})
	}
}

func (f *facts) assign(lhs, rhs ast.Expr) {
	switch l := ast.Unparen(lhs).(type) {
	case *ast.Ident:
		if v := f.varOf(l); v != nil {
			f.bind(v, rhs)
		}
	case *ast.SelectorExpr:
		sel := f.info.Selections[l]
		if sel == nil || sel.Kind() != types.FieldVal {
			return
		}
		target := f.resolve(l.X)
		if target == nil {
			return
		}
		field := sel.Obj().(*types.Var)
		switch {
		case field.Name() == "Method" && isRequest(sel.Recv()):
			m, _ := constString(f.info, rhs)
			f.val(target).origins = append(f.val(target).origins, origin{kind: originRequest, method: m})
		case field.Name() == "Header" && isRequest(sel.Recv()):
			if f.headerMayCarryKey(rhs) {
				f.val(target).keySet = true
			}
		case field.Name() == "IdempotencyKey" && isStripePath(field.Pkg().Path()):
			if !f.isNil(rhs) {
				f.val(target).keySet = true
			}
		case field.Embedded() && isStripeParams(field.Type()):
			// params.Params = stripe.Params{IdempotencyKey: ...}
			if f.paramsMayCarryKey(rhs) {
				f.val(target).keySet = true
			}
		}
	case *ast.IndexExpr:
		// req.Header["Idempotency-Key"] = []string{key}
		if isHeader(f.info.TypeOf(l.X)) && f.isKeyName(l.Index) {
			if target := f.resolve(l.X); target != nil {
				f.val(target).keySet = true
			}
		}
	}
}

// bind records that variable v is assigned rhs.
func (f *facts) bind(v *types.Var, rhs ast.Expr) {
	switch {
	case isRequest(v.Type()):
		if method, key, ok := f.requestLiteral(rhs); ok {
			val := f.val(v)
			val.origins = append(val.origins, origin{kind: originRequest, method: method})
			val.keySet = val.keySet || key
			return
		}
	case isStripeParams(v.Type()):
		if built, key := f.stripeBuilt(rhs); built {
			val := f.val(v)
			val.origins = append(val.origins, origin{kind: originStripe})
			val.keySet = val.keySet || key
			return
		}
	}
	if w := f.resolve(rhs); w != nil {
		f.union(v, w)
		return
	}
	f.val(v).origins = append(f.val(v).origins, origin{kind: originUnknown})
}

// requestLiteral recognises &http.Request{...} and http.Request{...}.
func (f *facts) requestLiteral(e ast.Expr) (method string, keySet, ok bool) {
	e = ast.Unparen(e)
	if u, isAddr := e.(*ast.UnaryExpr); isAddr && u.Op == token.AND {
		e = ast.Unparen(u.X)
	}
	lit, isLit := e.(*ast.CompositeLit)
	if !isLit || !isRequest(f.info.TypeOf(lit)) {
		return "", false, false
	}
	method = "GET" // the zero Method means GET (see http.Request.Method)
	for _, elt := range lit.Elts {
		kv, isKV := elt.(*ast.KeyValueExpr)
		if !isKV {
			continue
		}
		key, isIdent := kv.Key.(*ast.Ident)
		if !isIdent {
			continue
		}
		switch key.Name {
		case "Method":
			method, _ = constString(f.info, kv.Value)
		case "Header":
			keySet = keySet || f.headerMayCarryKey(kv.Value)
		}
	}
	return method, keySet, true
}

// stripeBuilt recognises a stripe params value created by the expression
// itself: a composite literal, new(T) or nil. key tells whether the
// literal already carries an idempotency key.
func (f *facts) stripeBuilt(e ast.Expr) (built, key bool) {
	e = ast.Unparen(e)
	if u, ok := e.(*ast.UnaryExpr); ok && u.Op == token.AND {
		e = ast.Unparen(u.X)
	}
	switch e := e.(type) {
	case *ast.CompositeLit:
		if isStripeParams(f.info.TypeOf(e)) {
			return true, f.paramsMayCarryKey(e)
		}
	case *ast.CallExpr:
		if id, ok := ast.Unparen(e.Fun).(*ast.Ident); ok && len(e.Args) == 1 {
			if b, ok := f.info.Uses[id].(*types.Builtin); ok && b.Name() == "new" {
				return isStripeParams(f.info.TypeOf(e.Args[0])), false
			}
		}
	}
	return f.isNil(e), false
}

// paramsMayCarryKey reports whether a stripe params literal (or the value
// assigned to its embedded Params) sets IdempotencyKey. A Params field
// filled from a variable or a call might carry one, so it counts as set.
func (f *facts) paramsMayCarryKey(e ast.Expr) bool {
	e = ast.Unparen(e)
	if u, ok := e.(*ast.UnaryExpr); ok && u.Op == token.AND {
		e = ast.Unparen(u.X)
	}
	lit, ok := e.(*ast.CompositeLit)
	if !ok {
		return !f.isNil(e)
	}
	for _, elt := range lit.Elts {
		kv, ok := elt.(*ast.KeyValueExpr)
		if !ok {
			continue
		}
		key, ok := kv.Key.(*ast.Ident)
		if !ok {
			continue
		}
		field, ok := f.info.Uses[key].(*types.Var)
		if !ok || !field.IsField() {
			continue
		}
		switch {
		case field.Name() == "IdempotencyKey" && isStripePath(field.Pkg().Path()):
			if !f.isNil(kv.Value) {
				return true
			}
		case field.Embedded() && isStripeParams(field.Type()):
			if f.paramsMayCarryKey(kv.Value) {
				return true
			}
		}
	}
	return false
}

// headerMayCarryKey reports whether a value assigned to Request.Header
// might contain the idempotency key. Only literals and make() can be
// proven not to; anything else (another request's headers, a helper's
// result) is given the benefit of the doubt.
func (f *facts) headerMayCarryKey(e ast.Expr) bool {
	e = ast.Unparen(e)
	switch e := e.(type) {
	case *ast.CompositeLit:
		for _, elt := range e.Elts {
			if kv, ok := elt.(*ast.KeyValueExpr); ok && f.isKeyName(kv.Key) {
				return true
			}
		}
		return false
	case *ast.CallExpr:
		if id, ok := ast.Unparen(e.Fun).(*ast.Ident); ok {
			if b, ok := f.info.Uses[id].(*types.Builtin); ok && b.Name() == "make" {
				return false
			}
		}
	}
	return !f.isNil(e)
}

// isKeyName reports whether a header name expression is, or might be,
// Idempotency-Key. A name computed at run time (a loop over a header map,
// say) might be, so it counts: the analyzer only reports what it can prove.
func (f *facts) isKeyName(e ast.Expr) bool {
	name, ok := constString(f.info, e)
	return !ok || strings.EqualFold(name, idempotencyHeader)
}

// isBlank reports whether e is a constant string of nothing but spaces.
func (f *facts) isBlank(e ast.Expr) bool {
	s, ok := constString(f.info, e)
	return ok && strings.TrimSpace(s) == ""
}

func (f *facts) isNil(e ast.Expr) bool {
	tv, ok := f.info.Types[ast.Unparen(e)]
	return ok && tv.IsNil()
}

// call records key-setting calls: Header.Set/Add, Params.SetIdempotencyKey
// and same-package helpers known to set the key on one of their arguments.
func (f *facts) call(call *ast.CallExpr) {
	fn := callee(f.info, call)
	if fn == nil {
		return
	}
	recv, args := recvAndArgs(f.info, call)
	switch {
	case isMethod(fn, httpPkg, "Header", "Set"), isMethod(fn, httpPkg, "Header", "Add"):
		// A key that is a constant blank string is no key: the provider would take every such
		// request as a new one (or all of them as one).
		if recv != nil && len(args) > 1 && f.isKeyName(args[0]) && !f.isBlank(args[1]) {
			if target := f.resolve(recv); target != nil {
				f.val(target).keySet = true
			}
		}
	case fn.Name() == "SetIdempotencyKey" && fn.Pkg() != nil && isStripePath(fn.Pkg().Path()):
		if recv != nil {
			if target := f.resolve(recv); target != nil {
				f.val(target).keySet = true
			}
		}
	default:
		if s := f.helpers[fn]; s != nil {
			for i := range s.setsKey {
				if i < len(args) {
					if target := f.resolve(args[i]); target != nil {
						f.val(target).keySet = true
					}
				}
			}
		}
	}
}
