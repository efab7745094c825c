// Command etcd is the etcd server at the version pinned in go.mod, for the dev cluster.
// etcd's own main lives in a module with replace directives, which `go install` refuses,
// so this wrapper calls the same entry point from go.etcd.io/etcd/server/v3.
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() {
	etcdmain.Main(os.Args)
}
