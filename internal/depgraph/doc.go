// Package depgraph holds tests of the module's import graph: what a program pulls in by importing
// txbox's libraries, and which packages may depend on which. It has no code of its own.
package depgraph
