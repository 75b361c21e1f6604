"""Pictures embedded in a memory-mapped Arrow table, held by a record as a reference (`TableImage`), not as bytes.

A `datasets` folder (save_to_disk) or the Arrow file `datasets` converts parquet/json/csv files to is mapped into
memory, not read: its pages sit in the page cache, once per node, shared by every rank that maps it. A record of
such data holds where its picture is (the Arrow file, row, column and place in the row's list), a few hundred
bytes however large the picture, and its bytes are copied out only when it is decoded, hashed or saved
(`TableImage.read`). A reference pickles as that position (a process pool's worker or another rank maps the file
itself), and each process maps a file once (`table`).

`references` turns a batch's picture column into the values `loaders.example_from_row` reads, references in place
of the bytes; the "hf" loader uses it where every row of its dataset is a row of the dataset's mapped files.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import pyarrow as pa


@dataclass(frozen=True, slots=True)
class TableImage:
    """An encoded picture (PNG, JPEG, ...) in a mapped Arrow file: a binary value, or the "bytes" of a datasets
    Image value ({"bytes", "path"}), alone in its cell or at `index` in the cell's list."""

    file: str
    """The Arrow file (IPC stream format, as `datasets` writes it)."""
    row: int
    """The row within that file."""
    column: str
    index: int | None
    """The picture's place in the cell's list; None for a cell holding one picture."""
    stamp: str = field(repr=False)
    """The file's identity when the reference was made (`image_checks.identity`): the picture check cache's key."""

    def __eq__(self, other: object) -> bool:
        # equal to the bytes it refers to: a record that refers to a picture equals one that embeds it (the same
        # picture, the same example); two references are equal where they point
        if isinstance(other, bytes):
            return self.read() == other
        if isinstance(other, TableImage):
            return _where(self) == _where(other)
        return NotImplemented

    def __hash__(self) -> int:
        return hash(_where(self))

    def read(self) -> bytes:
        """The picture's encoded bytes, copied out of the mapped file."""
        value = table(self.file).column(self.column)[self.row]
        if self.index is not None:
            value = value[self.index]
        if value.type.num_fields:  # a {"bytes", "path"} Image value
            value = value["bytes"]
        return value.as_py()


def _where(picture: TableImage) -> tuple:
    return picture.file, picture.row, picture.column, picture.index, picture.stamp


_TABLES: dict[str, pa.Table] = {}


def table(file: str) -> pa.Table:
    """The Arrow file's table, memory-mapped (the file's pages are read as they are touched); once per process."""
    if file not in _TABLES:
        import pyarrow as pa

        _TABLES[file] = pa.ipc.open_stream(pa.memory_map(file)).read_all()  # zero-copy: buffers point into the map
    return _TABLES[file]


def mapped_rows(dataset, column: str) -> list[tuple[str, int]] | None:
    """(Arrow file, its rows) of each file behind a `datasets.Dataset`, in order, when the dataset's rows are those
    files' rows one for one and `column` is stored there as the dataset reads it; else None (an in-memory table, an
    indices mapping from select/shuffle, a slice, a cast column: the records keep the bytes)."""
    if dataset._indices is not None:
        return None
    files = [entry["filename"] for entry in dataset.cache_files]
    tables = [table(file) for file in files]
    wanted = dataset.data.schema.field(column).type
    if sum(t.num_rows for t in tables) != dataset.num_rows or any(
        column not in t.column_names or t.schema.field(column).type != wanted for t in tables
    ):
        return None
    return [(file, t.num_rows) for file, t in zip(files, tables)]


def locator(files: list[tuple[str, int]]) -> Callable[[int], tuple[str, int]]:
    """dataset row -> (its Arrow file, its row there), for the `mapped_rows` of a dataset."""
    starts, total = [], 0
    for _, rows in files:
        starts.append(total)
        total += rows

    def locate(row: int) -> tuple[str, int]:
        k = bisect_right(starts, row) - 1
        return files[k][0], row - starts[k]

    return locate


def picture_type(kind: pa.DataType) -> bool:
    """Whether a column of this Arrow type holds pictures a `TableImage` reads: binary, a datasets Image struct
    ({"bytes", "path"}), or a list of either."""
    import pyarrow as pa

    if pa.types.is_list(kind) or pa.types.is_large_list(kind):
        kind = kind.value_type
    if pa.types.is_struct(kind):
        names = {kind.field(i).name for i in range(kind.num_fields)}
        return "bytes" in names and names <= {"bytes", "path"} and _binary(kind.field("bytes").type)
    return _binary(kind)


def _binary(kind: pa.DataType) -> bool:
    import pyarrow as pa

    return pa.types.is_binary(kind) or pa.types.is_large_binary(kind)


def references(column: pa.ChunkedArray, refer: Callable[[int, int | None], TableImage]) -> list:
    """The column's cells as `to_pylist` gives them (a `picture_type` column), each non-empty picture's bytes
    replaced by refer(row in the column, index in the cell's list or None); an empty or null one kept as it is (the
    loaders drop such records with their own reasons)."""
    cells: list = []
    for chunk in column.chunks:
        cells += _chunk_references(chunk, len(cells), refer)
    return cells


def _chunk_references(chunk: pa.Array, base: int, refer: Callable[[int, int | None], TableImage]) -> list:
    """`references` of one chunk, whose first row is the column's row `base`."""
    import pyarrow as pa

    if not (pa.types.is_list(chunk.type) or pa.types.is_large_list(chunk.type)):
        return _pictures(chunk, [(base + k, None) for k in range(len(chunk))], refer)
    offsets = chunk.offsets.to_pylist()  # into chunk.values (flatten() would drop the values under a null list)
    first = offsets[0]
    places = [
        (base + row, k - offsets[row]) for row in range(len(chunk)) for k in range(offsets[row], offsets[row + 1])
    ]
    values = _pictures(chunk.values.slice(first, offsets[-1] - first), places, refer)
    valid = chunk.is_valid().to_pylist()
    return [values[offsets[r] - first : offsets[r + 1] - first] if valid[r] else None for r in range(len(chunk))]


def _pictures(array: pa.Array, places: list[tuple[int, int | None]], refer: Callable) -> list:
    """A binary or Image-struct array's values as `to_pylist` gives them, each non-empty picture's bytes as
    refer(*places[position]). Lengths come from the offsets alone: no picture's bytes are touched."""
    import pyarrow.compute as pc

    struct = bool(array.type.num_fields)
    lengths = pc.binary_length(array.field("bytes") if struct else array).to_pylist()
    names = [array.type.field(i).name for i in range(array.type.num_fields)]
    others = {name: array.field(name).to_pylist() for name in names if name != "bytes"}
    out = []
    for k, (valid, length) in enumerate(zip(array.is_valid().to_pylist(), lengths)):
        if not (valid and length):
            out.append(array[k].as_py())  # null or empty: no picture's bytes in it, kept as stored
        elif struct:
            out.append({name: refer(*places[k]) if name == "bytes" else others[name][k] for name in names})
        else:
            out.append(refer(*places[k]))
    return out
