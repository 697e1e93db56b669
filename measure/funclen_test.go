package measure_test

import (
	"go/ast"
	"go/parser"
	"go/token"
	"path/filepath"
	"sort"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// funcLen is one function and its length in lines (from func to the closing brace).
type funcLen struct {
	name  string
	lines int
}

// longestFuncs lists the functions (and methods, and function literals at the top level of a
// declaration count as part of it) of the non-test Go files in dir, longest first.
func longestFuncs(t *testing.T, dir string) []funcLen {
	t.Helper()
	fset := token.NewFileSet()
	files, err := filepath.Glob(filepath.Join(dir, "*.go"))
	require.NoError(t, err)
	var out []funcLen
	for _, path := range files {
		if strings.HasSuffix(path, "_test.go") {
			continue
		}
		f, err := parser.ParseFile(fset, path, nil, 0)
		require.NoError(t, err)
		for _, d := range f.Decls {
			fd, ok := d.(*ast.FuncDecl)
			if !ok || fd.Body == nil {
				continue
			}
			name := fd.Name.Name
			if fd.Recv != nil && len(fd.Recv.List) > 0 {
				name = types(fd.Recv.List[0].Type) + "." + name
			}
			lines := fset.Position(fd.End()).Line - fset.Position(fd.Pos()).Line + 1
			out = append(out, funcLen{filepath.Base(path) + ": " + name, lines})
		}
	}
	sort.Slice(out, func(i, j int) bool { return out[i].lines > out[j].lines })
	return out
}

func types(e ast.Expr) string {
	switch x := e.(type) {
	case *ast.StarExpr:
		return "*" + types(x.X)
	case *ast.Ident:
		return x.Name
	case *ast.IndexExpr:
		return types(x.X)
	}
	return "?"
}

// TestFunctionLength keeps functions short enough to read on one screen: none in this package over
// 100 lines, none in cmd/vmmdemo over 80. It logs the five longest of each (go test -v -run
// TestFunctionLength ./measure, or scripts/funclen.sh).
func TestFunctionLength(t *testing.T) {
	for _, c := range []struct {
		dir   string
		limit int
	}{{".", 100}, {filepath.Join("..", "cmd", "vmmdemo"), 80}} {
		fns := longestFuncs(t, c.dir)
		require.NotEmpty(t, fns, c.dir)
		for i, f := range fns[:min(5, len(fns))] {
			t.Logf("%s #%d: %3d lines  %s", c.dir, i+1, f.lines, f.name)
		}
		for _, f := range fns {
			require.LessOrEqual(t, f.lines, c.limit, "%s in %s is longer than %d lines: split it", f.name, c.dir, c.limit)
		}
	}
}
