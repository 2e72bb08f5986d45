"""How a value becomes bytes and back, with no pickle: codecs (raw segments + a JSON meta), the
JSON vocabulary of array metas, trees of containers and live objects (skeleton, matching,
in-place restore), and strict bounded JSON for everything read from a file."""
