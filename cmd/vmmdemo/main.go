// Command vmmdemo demonstrates and measures cuvmm on the real GPU or, when there is none, on the
// simulated driver. Each subcommand verifies what it does (patterns written and checked) and
// measures against the obvious baseline in the same run; --json gives machine-readable output.
//
//	vmmdemo info      [--json] [--backend auto|cuda|sim] [--sim-devices N]
//	vmmdemo grow      --to SIZE --step SIZE [--device N] [--chunk SIZE] [--json]
//	vmmdemo stripe    --devices 0,1 --size SIZE [--stripe SIZE | --layout blocked] [--access-only LIST|all] [--json]
//	vmmdemo share     --size SIZE --chunks N [--location device|host] [--json]
//	vmmdemo bandwidth [--device N] [--json]
//	vmmdemo pinned    --size SIZE --procs N [--devices LIST] [--json]
//	vmmdemo broker    --size SIZE --workers N [--json]
//	vmmdemo sleep     --size SIZE [--devices LIST] [--mode keep|discard|file] [--file PATH] [--json]
//	vmmdemo pool      [--trace FILE | --synthetic serving] [--streams N] [--peer torch] [--json]
//	vmmdemo xfer      --size SIZE [--transport auto|socket] [--register] [--peer torch] [--json]
//	vmmdemo plot      --in RESULT.json --out FILE.svg
//	vmmdemo tour      [--backend ...]   every subcommand with small sizes
//
// Run "vmmdemo help" for the list of subcommands.
package main

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"sort"
	"strings"
	"sync"

	"golang.org/x/term"

	"github.com/cuvmm/cuvmm/measure"
)

// command is one subcommand. Each lives in a file of its own that registers it in an init()
// (register(&command{...})) and does three things: parse its flags (newFlags, common.register,
// parse), call its measurement in package measure, and render the result (measureAndShow: text
// through the result's Text method, or --json through encoding/json). The measuring itself, and
// any worker process, belongs in package measure.
type command struct {
	name    string
	summary string
	run     func(env *env, args []string) error
	// tour is the argument list the tour runs the subcommand with (small sizes); nil leaves it out.
	tour []string
}

var commands = map[string]*command{}

func register(c *command) { commands[c.name] = c }

// env is what a subcommand writes to.
type env struct {
	stdout, stderr io.Writer
	// interactive is true when stderr is a terminal (progress bars are drawn only then).
	interactive bool

	mu   sync.Mutex
	dirs []string // temporary directories to remove (tempDir)
}

func main() {
	measure.RunWorker() // a measurement's worker process runs its role here and exits
	os.Exit(runProcess(os.Args[1:]))
}

// runProcess runs vmmdemo as this process: on its standard streams, removing what earlier runs
// killed with SIGKILL left behind, and cleaning up on SIGINT and SIGTERM.
func runProcess(args []string) int {
	e := &env{stdout: os.Stdout, stderr: os.Stderr, interactive: term.IsTerminal(int(os.Stderr.Fd()))}
	removeStale(os.TempDir())
	stop := e.cleanUpOnSignal()
	defer stop()
	return run(e, args)
}

func run(e *env, args []string) int {
	if len(args) == 0 {
		usage(e.stderr)
		return 2
	}
	if args[0] == "help" || args[0] == "-h" || args[0] == "--help" {
		usage(e.stdout)
		return 0
	}
	c, ok := commands[args[0]]
	if !ok {
		fmt.Fprintf(e.stderr, "vmmdemo: unknown subcommand %q\n\n", args[0])
		usage(e.stderr)
		return 2
	}
	err := c.run(e, args[1:])
	e.removeTempDirs()
	if err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return 0
		}
		fmt.Fprintf(e.stderr, "vmmdemo %s: %s\n", c.name, strings.TrimSuffix(err.Error(), ": "+errUsage.Error()))
		if errors.Is(err, errUsage) {
			return 2
		}
		return 1
	}
	return 0
}

// errUsage marks a bad command line (exit status 2); measure's option errors count as one.
var errUsage = measure.ErrInvalidOption

func usage(w io.Writer) {
	fmt.Fprintln(w, "usage: vmmdemo <subcommand> [flags]   (vmmdemo <subcommand> -h for its flags)")
	fmt.Fprintln(w)
	names := make([]string, 0, len(commands))
	for n := range commands {
		names = append(names, n)
	}
	sort.Strings(names)
	for _, n := range names {
		fmt.Fprintf(w, "  %-10s %s\n", n, commands[n].summary)
	}
}
