//go:build tools

// Package tools pins the command the dev cluster builds (`weed`, SeaweedFS's S3-compatible
// server), so `go mod tidy` keeps its deps. seaweedfs's go.mod has a replace directive, which
// `go install PKG@VERSION` refuses and which does not apply to a dependant, so it is repeated here.
package tools

import (
	_ "github.com/seaweedfs/seaweedfs/weed"
)
