package idemkey

import (
	"fmt"
	"go/ast"
	"go/token"
	"go/types"
	"strings"

	"golang.org/x/tools/go/analysis"
)

// Analyzer reports side-effecting HTTP and stripe-go calls made from
// Watermill consumer code without an idempotency key. See the package
// documentation for what it finds, its limits and the opt-out comment.
var Analyzer = &analysis.Analyzer{
	Name: "idemkey",
	Doc: `report non-idempotent HTTP calls without an Idempotency-Key in Watermill handlers

Watermill delivers messages at least once, so a handler that POSTs to an
external API without an Idempotency-Key repeats the side effect on every
redelivery. idemkey finds Watermill handlers (and the same-package code
they call) and reports http.Post, http.PostForm, (*http.Client).Post,
PostForm and Do of POST/PUT/PATCH/DELETE requests that set no
Idempotency-Key header, and mutating stripe-go calls whose params carry no
idempotency key. Suppress a report with
	//txbox:nolint-idempotency <reason>
on the line of the call or the line above.`,
	URL: "https://pkg.go.dev/github.com/txbox/txbox/lint/idemkey",
	Run: run,
}

// directive is the opt-out comment. It follows the //go: and //lint:
// convention of no space after the slashes so it reads as a machine
// directive, not prose.
const directive = "//txbox:nolint-idempotency"

// unit is a body whose tracked values are analysed together: a function
// declaration, or a func literal in a package-level var initializer.
type unit struct {
	body  *ast.BlockStmt
	fn    *types.Func  // the declared function; nil for a literal
	lit   *ast.FuncLit // the package-level literal; nil for a declaration
	name  string       // for diagnostics
	facts *facts
}

// region is consumer code: a body that runs while a Watermill message is
// being handled and so may run again when the message is redelivered.
type region struct {
	unit    *unit
	body    ast.Node
	handler string // the Watermill handler this code runs under
	via     string // the reached function's name; "" for the handler itself
}

type checker struct {
	pass    *analysis.Pass
	units   []*unit
	decls   map[*types.Func]*unit
	helpers map[*types.Func]*summary
	optOuts map[lineKey]bool
	// reported is keyed by node, not position: in getClient().Do(req) both
	// calls start at the same position.
	reported map[*ast.CallExpr]bool
}

type lineKey struct {
	file string
	line int
}

func run(pass *analysis.Pass) (any, error) {
	c := &checker{
		pass:     pass,
		decls:    make(map[*types.Func]*unit),
		helpers:  make(map[*types.Func]*summary),
		optOuts:  make(map[lineKey]bool),
		reported: make(map[*ast.CallExpr]bool),
	}
	c.readDirectives()
	c.collectUnits()
	roots := c.roots()
	if len(roots) == 0 {
		// Most packages have no Watermill handlers; skip the summaries.
		return nil, nil
	}
	c.computeSummaries()
	for _, r := range c.reach(roots) {
		c.check(r)
	}
	return nil, nil
}

// readDirectives indexes the opt-out comments by line and reports those
// without a reason: an unexplained opt-out is indistinguishable from a
// silenced bug in review.
func (c *checker) readDirectives() {
	for _, file := range c.pass.Files {
		for _, group := range file.Comments {
			for _, cm := range group.List {
				rest, ok := strings.CutPrefix(cm.Text, directive)
				if !ok || (rest != "" && rest[0] != ' ' && rest[0] != '\t') {
					continue
				}
				pos := c.pass.Fset.Position(cm.Slash)
				c.optOuts[lineKey{pos.Filename, pos.Line}] = true
				if strings.TrimSpace(rest) == "" {
					c.pass.Reportf(cm.Slash, "%s needs a reason: say why repeating this call on message redelivery is safe", directive)
				}
			}
		}
	}
}

func (c *checker) collectUnits() {
	info := c.pass.TypesInfo
	for _, file := range c.pass.Files {
		for _, decl := range file.Decls {
			switch decl := decl.(type) {
			case *ast.FuncDecl:
				fn, ok := info.Defs[decl.Name].(*types.Func)
				if !ok || decl.Body == nil {
					continue
				}
				u := &unit{body: decl.Body, fn: fn, name: funcName(fn)}
				c.units = append(c.units, u)
				c.decls[fn] = u
			case *ast.GenDecl:
				for _, spec := range decl.Specs {
					vs, ok := spec.(*ast.ValueSpec)
					if !ok {
						continue
					}
					for _, val := range vs.Values {
						ast.Inspect(val, func(n ast.Node) bool {
							lit, ok := n.(*ast.FuncLit)
							if !ok {
								return true
							}
							c.units = append(c.units, &unit{body: lit.Body, lit: lit, name: vs.Names[0].Name})
							return false // nested literals belong to this unit
						})
					}
				}
			}
		}
	}
}

// funcName names a function the way a reader would look it up:
// "handle", "Consumer.Handle" or "(*Consumer).Handle".
func funcName(fn *types.Func) string {
	recv := fn.Signature().Recv()
	if recv == nil {
		return fn.Name()
	}
	t := types.Unalias(recv.Type())
	ptr := false
	if p, ok := t.(*types.Pointer); ok {
		t, ptr = types.Unalias(p.Elem()), true
	}
	name := types.TypeString(t, func(*types.Package) string { return "" })
	if i := strings.IndexByte(name, '['); i >= 0 {
		name = name[:i] // drop type arguments of generic receivers
	}
	if ptr {
		return fmt.Sprintf("(*%s).%s", name, fn.Name())
	}
	return name + "." + fn.Name()
}

// roots finds the Watermill handlers: every function, method and closure
// with the HandlerFunc or NoPublishHandlerFunc shape, plus whatever this
// package registers with the Router's Add*Handler methods.
func (c *checker) roots() []region {
	info := c.pass.TypesInfo
	var roots []region
	seen := make(map[ast.Node]bool)
	add := func(u *unit, body ast.Node, name string) {
		if !seen[body] {
			seen[body] = true
			roots = append(roots, region{unit: u, body: body, handler: name})
		}
	}
	for _, u := range c.units {
		switch {
		case u.fn != nil && isHandlerSig(u.fn.Type()),
			u.lit != nil && isHandlerSig(info.TypeOf(u.lit)):
			add(u, u.body, u.name)
		}
	}
	for _, u := range c.units {
		ast.Inspect(u.body, func(n ast.Node) bool {
			switch n := n.(type) {
			case *ast.FuncLit:
				if isHandlerSig(info.TypeOf(n)) {
					add(u, n.Body, "func literal in "+u.name)
				}
			case *ast.CallExpr:
				// The Router's parameter types force the handler shape,
				// so registrations are already covered by the check above;
				// resolving them as well keeps a registered handler a root
				// should the shape check ever be narrowed.
				if fn := callee(info, n); fn != nil && isRouterAdd(fn) && len(n.Args) > 0 {
					if h := c.staticFunc(n.Args[len(n.Args)-1]); h != nil {
						add(h, h.body, h.name)
					}
				}
			}
			return true
		})
	}
	return roots
}

func isRouterAdd(fn *types.Func) bool {
	for _, name := range []string{"AddHandler", "AddNoPublisherHandler", "AddConsumerHandler"} {
		if isMethod(fn, messagePkg, "Router", name) {
			return true
		}
	}
	return false
}

// staticFunc resolves a handler expression (f, pkg.F, x.M, T.M, or a
// conversion like message.HandlerFunc(f)) to a function declared in this
// package.
func (c *checker) staticFunc(e ast.Expr) *unit {
	info := c.pass.TypesInfo
	switch e := ast.Unparen(e).(type) {
	case *ast.Ident:
		if fn, ok := info.Uses[e].(*types.Func); ok {
			return c.decls[fn.Origin()]
		}
	case *ast.SelectorExpr:
		if fn, ok := info.Uses[e.Sel].(*types.Func); ok {
			return c.decls[fn.Origin()]
		}
	case *ast.CallExpr:
		if tv, ok := info.Types[e.Fun]; ok && tv.IsType() && len(e.Args) == 1 {
			return c.staticFunc(e.Args[0])
		}
	}
	return nil
}

// reach extends the handler roots with every same-package function they
// use, transitively. Any use counts, not only calls, so that a method
// value handed to a retry helper or errgroup is followed too. Interface
// method calls have no declaration to follow and are not.
func (c *checker) reach(roots []region) []region {
	info := c.pass.TypesInfo
	visited := make(map[*unit]bool)
	for _, r := range roots {
		if r.body == ast.Node(r.unit.body) {
			visited[r.unit] = true
		}
	}
	queue := roots
	for i := 0; i < len(queue); i++ {
		r := queue[i]
		ast.Inspect(r.body, func(n ast.Node) bool {
			id, ok := n.(*ast.Ident)
			if !ok {
				return true
			}
			fn, ok := info.Uses[id].(*types.Func)
			if !ok {
				return true
			}
			if u := c.decls[fn.Origin()]; u != nil && !visited[u] {
				visited[u] = true
				queue = append(queue, region{unit: u, body: u.body, handler: r.handler, via: u.name})
			}
			return true
		})
	}
	return queue
}

// check reports the keyless sends in one region of consumer code.
func (c *checker) check(r region) {
	ast.Inspect(r.body, func(n ast.Node) bool {
		call, ok := n.(*ast.CallExpr)
		if !ok || c.reported[call] {
			return true
		}
		for _, cs := range sinksOf(c.pass.TypesInfo, c.helpers, call) {
			v := judge(r.unit.facts, cs)
			if !v.report {
				continue
			}
			c.reported[call] = true
			if c.optedOut(call.Pos()) {
				break
			}
			where := "a Watermill handler"
			if r.via != "" {
				where = fmt.Sprintf("%s (called from Watermill handler %s)", r.via, r.handler)
			}
			fix := "set the header"
			if cs.kind == sinkStripe {
				fix = "set one with params.SetIdempotencyKey"
			}
			c.pass.Reportf(call.Pos(), "%s in %s sends a non-idempotent request without an Idempotency-Key; "+
				"enqueue it with outbox.Call so the relay sends it with a stable key, or %s", v.desc, where, fix)
			break
		}
		return true
	})
}

// optedOut reports whether an opt-out comment sits on the call's line or
// the line above it.
func (c *checker) optedOut(pos token.Pos) bool {
	p := c.pass.Fset.Position(pos)
	return c.optOuts[lineKey{p.Filename, p.Line}] || c.optOuts[lineKey{p.Filename, p.Line - 1}]
}
