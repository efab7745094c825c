"""Print the requirements of pyproject.toml plus the named extras, one per line (stdlib only).

Self-references such as ``kvpilot[runtime,operator]`` are expanded, so pip never needs to build
the project itself to resolve them.
"""

import sys
import tomllib


def requirements(pyproject: dict, extras: list[str], seen: set[str]) -> list[str]:
    project = pyproject["project"]
    out: list[str] = []
    for extra in extras:
        if extra in seen:
            continue
        seen.add(extra)
        for req in project["optional-dependencies"][extra]:
            if req.startswith(project["name"] + "["):
                nested = req.split("[", 1)[1].rstrip("]").split(",")
                out += requirements(pyproject, [e.strip() for e in nested], seen)
            else:
                out.append(req)
    return out


def main() -> None:
    with open(sys.argv[1], "rb") as f:
        pyproject = tomllib.load(f)
    reqs = list(pyproject["project"]["dependencies"])
    reqs += requirements(pyproject, sys.argv[2:], set())
    print("\n".join(dict.fromkeys(reqs)))


if __name__ == "__main__":
    main()
