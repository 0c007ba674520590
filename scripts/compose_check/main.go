// Command compose-check validates compose files without a Docker engine.
//
// It loads them with compose-go, the library `docker compose` itself uses, so a
// file passes here when `docker compose config` would accept it: Compose
// specification schema, ${VAR:-default} interpolation, and the cross-references
// (depends_on, volumes, networks). On top of that it checks what compose only
// finds out at build or pull time: that every build context holds its
// Dockerfile, and that every pulled image names a pinned tag.
//
//	compose-check [-print] compose.yaml [override.yaml...]
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strings"

	"github.com/compose-spec/compose-go/v2/cli"
	"github.com/compose-spec/compose-go/v2/types"
)

func main() {
	printProject := flag.Bool("print", false, "print the resolved project as YAML")
	flag.Usage = func() {
		fmt.Fprintln(os.Stderr, "usage: compose-check [-print] compose.yaml [override.yaml...]")
		flag.PrintDefaults()
	}
	flag.Parse()
	if flag.NArg() == 0 {
		flag.Usage()
		os.Exit(2)
	}

	project, err := load(flag.Args())
	if err != nil {
		fmt.Fprintf(os.Stderr, "compose-check: invalid: %v\n", err)
		os.Exit(1)
	}
	if problems := checkBuildContexts(project); len(problems) > 0 {
		fmt.Fprintf(os.Stderr, "compose-check: invalid:\n  %s\n", strings.Join(problems, "\n  "))
		os.Exit(1)
	}
	if problems := checkPinnedImages(project); len(problems) > 0 {
		fmt.Fprintf(os.Stderr, "compose-check: invalid:\n  %s\n", strings.Join(problems, "\n  "))
		os.Exit(1)
	}

	if *printProject {
		out, err := project.MarshalYAML()
		if err != nil {
			fmt.Fprintf(os.Stderr, "compose-check: %v\n", err)
			os.Exit(1)
		}
		os.Stdout.Write(out)
	}
	names := project.ServiceNames()
	sort.Strings(names)
	fmt.Printf("compose-check: ok: %s: %d services (%s)\n",
		strings.Join(flag.Args(), ", "), len(names), strings.Join(names, ", "))
}

// load mirrors the options `docker compose` passes: the OS environment plus a
// .env file beside the compose file feed interpolation, and schema validation and
// the consistency check stay on (they are compose-go's defaults).
func load(files []string) (*types.Project, error) {
	options, err := cli.NewProjectOptions(files,
		cli.WithOsEnv,
		cli.WithDotEnv,
		cli.WithResolvedPaths(true),
	)
	if err != nil {
		return nil, err
	}
	return options.LoadProject(context.Background())
}

func checkBuildContexts(project *types.Project) []string {
	var problems []string
	for _, name := range project.ServiceNames() {
		build := project.Services[name].Build
		if build == nil || build.DockerfileInline != "" || isRemote(build.Context) {
			continue
		}
		dockerfile := build.Dockerfile
		if dockerfile == "" {
			dockerfile = "Dockerfile"
		}
		if !filepath.IsAbs(dockerfile) {
			dockerfile = filepath.Join(build.Context, dockerfile)
		}
		if _, err := os.Stat(dockerfile); err != nil {
			problems = append(problems, fmt.Sprintf("service %q: build needs %s: %v",
				name, dockerfile, errors.Unwrap(err)))
		}
	}
	return problems
}

func isRemote(buildContext string) bool {
	return strings.Contains(buildContext, "://") || strings.HasPrefix(buildContext, "git@")
}

// An untagged or :latest image makes the stack change under the user's feet
// between two pulls; services built here are exempt (their image is the build).
func checkPinnedImages(project *types.Project) []string {
	var problems []string
	for _, name := range project.ServiceNames() {
		service := project.Services[name]
		if service.Build != nil || service.Image == "" {
			continue
		}
		ref := service.Image
		if strings.Contains(ref, "@sha256:") {
			continue
		}
		lastPart := ref[strings.LastIndex(ref, "/")+1:]
		tag := ""
		if i := strings.LastIndex(lastPart, ":"); i >= 0 {
			tag = lastPart[i+1:]
		}
		if tag == "" || tag == "latest" {
			problems = append(problems, fmt.Sprintf(
				"service %q: image %q is not pinned to a version tag or digest", name, ref))
		}
	}
	return problems
}
