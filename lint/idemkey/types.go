package idemkey

import (
	"go/ast"
	"go/constant"
	"go/types"
	"strings"

	"golang.org/x/tools/go/types/typeutil"
)

const (
	messagePkg = "github.com/ThreeDotsLabs/watermill/message"
	httpPkg    = "net/http"

	// stripeModule matches every major version of stripe-go (the module
	// path of v82 is github.com/stripe/stripe-go/v82) and all of its
	// sub-packages, so an upgrade does not silently disable the check.
	stripeModule = "github.com/stripe/stripe-go"

	idempotencyHeader = "Idempotency-Key"
)

// isStripePath reports whether path is stripe-go or one of its packages.
func isStripePath(path string) bool {
	return path == stripeModule || strings.HasPrefix(path, stripeModule+"/")
}

// namedIn returns the named type behind t (looking through one pointer and
// any aliases) if it is declared in a package accepted by inPkg.
func namedIn(t types.Type, inPkg func(path string) bool) *types.Named {
	t = types.Unalias(t)
	if p, ok := t.(*types.Pointer); ok {
		t = types.Unalias(p.Elem())
	}
	n, ok := t.(*types.Named)
	if !ok || n.Obj().Pkg() == nil || !inPkg(n.Obj().Pkg().Path()) {
		return nil
	}
	return n
}

func isNamed(t types.Type, pkg, name string) bool {
	n := namedIn(t, func(p string) bool { return p == pkg })
	return n != nil && n.Obj().Name() == name
}

// isRequest matches http.Request and *http.Request.
func isRequest(t types.Type) bool { return isNamed(t, httpPkg, "Request") }

// isHeader matches http.Header (not a pointer: Header is a map).
func isHeader(t types.Type) bool {
	n, ok := types.Unalias(t).(*types.Named)
	return ok && n.Obj().Pkg() != nil && n.Obj().Pkg().Path() == httpPkg && n.Obj().Name() == "Header"
}

// isStripeParams matches the stripe-go parameter structs that can carry an
// idempotency key, i.e. those that embed stripe.Params (directly or not).
// Going by the promoted field rather than by a "Params" name suffix keeps
// ListParams (reads, no key) out and keeps stripe.Params itself in.
func isStripeParams(t types.Type) bool {
	n := namedIn(t, isStripePath)
	if n == nil {
		return false
	}
	if _, ok := n.Underlying().(*types.Struct); !ok {
		return false
	}
	obj, _, _ := types.LookupFieldOrMethod(n, true, nil, "IdempotencyKey")
	f, ok := obj.(*types.Var)
	return ok && f.IsField() && f.Pkg() != nil && isStripePath(f.Pkg().Path())
}

// tracked reports whether values of type t are followed through a function:
// requests, their headers and stripe params are the only things whose
// origin and idempotency key matter.
func tracked(t types.Type) bool {
	return isRequest(t) || isHeader(t) || isStripeParams(t)
}

// isMessagePtr matches *message.Message.
func isMessagePtr(t types.Type) bool {
	p, ok := types.Unalias(t).(*types.Pointer)
	return ok && isNamed(p.Elem(), messagePkg, "Message")
}

var errorType = types.Universe.Lookup("error").Type()

// isHandlerSig reports whether t has the shape of message.HandlerFunc or
// message.NoPublishHandlerFunc. The check is structural rather than by
// named type because handlers are usually plain funcs and methods that are
// only converted to HandlerFunc when registered.
func isHandlerSig(t types.Type) bool {
	sig, ok := t.Underlying().(*types.Signature)
	if !ok || sig.Variadic() || sig.TypeParams().Len() > 0 || sig.Params().Len() != 1 {
		return false
	}
	if !isMessagePtr(sig.Params().At(0).Type()) {
		return false
	}
	res := sig.Results()
	switch res.Len() {
	case 1:
		return types.Identical(res.At(0).Type(), errorType)
	case 2:
		s, ok := types.Unalias(res.At(0).Type()).Underlying().(*types.Slice)
		return ok && isMessagePtr(s.Elem()) && types.Identical(res.At(1).Type(), errorType)
	}
	return false
}

// callee returns the function or method a call invokes, including
// interface methods, or nil for calls of func values, builtins and
// conversions. Generic functions are returned as their origin so they can
// be used as map keys.
func callee(info *types.Info, call *ast.CallExpr) *types.Func {
	fn, ok := typeutil.Callee(info, call).(*types.Func)
	if !ok {
		return nil
	}
	return fn.Origin()
}

// recvAndArgs splits a call into its receiver expression (nil for plain
// functions) and the arguments that line up with the signature's
// parameters. Method expressions (T.M(recv, args...)) pass the receiver as
// the first argument, which would otherwise shift every index by one.
func recvAndArgs(info *types.Info, call *ast.CallExpr) (recv ast.Expr, args []ast.Expr) {
	if sel, ok := ast.Unparen(call.Fun).(*ast.SelectorExpr); ok {
		if s := info.Selections[sel]; s != nil {
			switch s.Kind() {
			case types.MethodVal:
				return sel.X, call.Args
			case types.MethodExpr:
				if len(call.Args) == 0 {
					return nil, nil
				}
				return call.Args[0], call.Args[1:]
			}
		}
	}
	return nil, call.Args
}

// isMethod reports whether fn is the method name of a type named typ in pkg.
func isMethod(fn *types.Func, pkg, typ, name string) bool {
	if fn == nil || fn.Name() != name {
		return false
	}
	sig := fn.Signature()
	return sig.Recv() != nil && isNamed(sig.Recv().Type(), pkg, typ)
}

// isPkgFunc reports whether fn is the package-level function pkg.name.
func isPkgFunc(fn *types.Func, pkg, name string) bool {
	return fn != nil && fn.Name() == name && fn.Pkg() != nil && fn.Pkg().Path() == pkg &&
		fn.Signature().Recv() == nil
}

// constString returns the value of a string constant expression.
func constString(info *types.Info, e ast.Expr) (string, bool) {
	tv, ok := info.Types[e]
	if !ok || tv.Value == nil || tv.Value.Kind() != constant.String {
		return "", false
	}
	return constant.StringVal(tv.Value), true
}

// mutatingMethod reports whether an HTTP method changes server state and
// is therefore unsafe to repeat without an idempotency key. GET, HEAD and
// OPTIONS are safe by definition; PUT and DELETE are idempotent in theory
// but in practice many APIs (payment providers first) only deduplicate
// them with a key, so they are treated like POST.
func mutatingMethod(m string) bool {
	switch strings.ToUpper(m) {
	case "POST", "PUT", "PATCH", "DELETE":
		return true
	}
	return false
}

// stripeMutatingVerbs are the leading words of stripe-go API method names
// that issue a POST or DELETE. It is an allow-list (derived from the
// methods of stripe-go v82 that take a params struct) rather than a
// deny-list of reads, so that an unfamiliar verb is left alone instead of
// being reported: a missed report is cheaper than a wrong one.
var stripeMutatingVerbs = map[string]bool{
	"Accept": true, "Activate": true, "Add": true, "Advance": true,
	"Apply": true, "Approve": true, "Archive": true, "Attach": true,
	"Cancel": true, "Capture": true, "Close": true, "Collect": true,
	"Confirm": true, "Create": true, "Deactivate": true, "Decline": true,
	"Del": true, "Delete": true, "Deliver": true, "Detach": true,
	"Disable": true, "Disconnect": true, "Enable": true, "Expire": true,
	"Fail": true, "Finalize": true, "Fund": true, "Increment": true,
	"Mark": true, "Migrate": true, "New": true, "Pay": true, "Ping": true,
	"Post": true, "Present": true, "Process": true, "Reactivate": true,
	"Redact": true, "Refresh": true, "Refund": true, "Reject": true,
	"Release": true, "Remove": true, "Respond": true, "Resume": true,
	"Return": true, "Reverse": true, "Send": true, "Set": true, "Ship": true,
	"Submit": true, "Subscribe": true, "Succeed": true, "Timeout": true,
	"Unarchive": true, "Unsubscribe": true, "Update": true, "Validate": true,
	"Verify": true, "Void": true,
}

// stripeReadExceptions start with a mutating verb but only compute a
// preview and change nothing.
var stripeReadExceptions = map[string]bool{
	"CreatePreview": true,
}

// isStripeMutating reports whether a stripe-go method name is a write.
func isStripeMutating(name string) bool {
	if stripeReadExceptions[name] {
		return false
	}
	return stripeMutatingVerbs[leadingWord(name)]
}

// leadingWord returns the first word of a CamelCase identifier:
// "VoidInvoice" -> "Void", "New" -> "New".
func leadingWord(name string) string {
	for i, r := range name {
		if i > 0 && r >= 'A' && r <= 'Z' {
			return name[:i]
		}
	}
	return name
}
