"""Indexed lookups for onnxruntime's QDQ quantizer.

The quantizer finds an initializer by scanning the graph's initializer list and renames a
tensor's readers by scanning every node, once per quantized tensor: quadratic in the graph,
most of a quantize's time at E2B size. Here the same answers come from indexes kept up to date
as the quantizer edits the graph.

What the quantizer does to the two lists: appends (Q/DQ nodes, scales, zero points), removes a
few items (unused initializers), and rewrites node inputs in place through
`ONNXModel.replace_node_input` / `replace_input_of_all_nodes`. An index covers the first `seen`
items of its list; before each answer it indexes what was appended since, and starts over when
the list shrank or its last indexed item is no longer at its place (any removal before it
moves it). In-place input rewrites reach the reader index through `note_rewrite`.
`check=True` (tests) compares every answer with the full scan onnxruntime does."""

from __future__ import annotations

from collections import defaultdict


class _ListIndex:
    """Keys -> items of one protobuf repeated field, appended-to and occasionally shrunk."""

    def __init__(self, items):
        self.items = items  # protobuf keeps one wrapper per live element: identity is stable
        self.table, self.seen, self.last, self.members = defaultdict(list), 0, None, set()

    def keys(self, item):
        raise NotImplementedError

    def refresh(self) -> None:
        n = len(self.items)
        if n < self.seen or (self.seen and self.items[self.seen - 1] is not self.last):
            self.table, self.seen, self.members = defaultdict(list), 0, set()  # something was removed: index anew
        for item in self.items[self.seen:n]:
            for key in self.keys(item):
                self.table[key].append(item)
        self.seen = n
        self.last = self.items[n - 1] if n else None


class InitializerIndex(_ListIndex):
    """name -> the first initializer of that name (what `quant_utils.find_by_name` returns)."""

    def keys(self, item):
        return (item.name,)

    def find(self, name: str, check: bool = False):
        self.refresh()
        found = next((t for t in self.table.get(name, ()) if t.name == name), None)
        if check:
            scanned = next((t for t in self.items if t.name == name), None)
            if scanned is not found:
                raise AssertionError(f"initializer index: {name!r} -> {found and found.name!r}, scan -> "
                                     f"{scanned and scanned.name!r}")
        return found


class ReaderIndex(_ListIndex):
    """tensor name -> the nodes that may read it (a superset: a rewritten input is checked)."""

    def keys(self, node):
        self.members.add(id(node))  # the table holds the node: its id is not reused meanwhile
        return set(node.input)

    def readers(self, name: str, check: bool = False) -> list:
        self.refresh()
        # messages do not hash: a node listed twice (read, rewritten, read again) is kept once by id
        found = list({id(n): n for n in self.table.get(name, ()) if name in n.input}.values())
        if check:
            scanned = [n for n in self.items if name in n.input]
            if {id(n) for n in scanned} != {id(n) for n in found}:
                raise AssertionError(f"reader index: {name!r} has {len(found)} indexed readers, the scan "
                                     f"finds {len(scanned)}")
        return found

    def note_rewrite(self, node, new_name: str) -> None:
        if id(node) in self.members:  # a node of this list (another graph's index is left alone)
            self.table[new_name].append(node)


class QuantizerLookups:
    """The indexes of one quantizer run, keyed by the protobuf lists they cover."""

    def __init__(self, check: bool = False):
        self.check = check
        self.initializers: dict[int, InitializerIndex] = {}
        self.nodes: dict[int, ReaderIndex] = {}

    def _index(self, table: dict, items, kind):
        index = table.get(id(items))
        if index is None or index.items is not items:  # the index holds its list: ids are not reused
            index = table[id(items)] = kind(items)
        return index

    def find_initializer(self, name: str, initializers):
        return self._index(self.initializers, initializers, InitializerIndex).find(name, self.check)

    def readers(self, name: str, nodes) -> list:
        return self._index(self.nodes, nodes, ReaderIndex).readers(name, self.check)

    def note_rewrite(self, node, new_name: str) -> None:
        for index in self.nodes.values():
            index.note_rewrite(node, new_name)
