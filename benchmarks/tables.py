"""The table that data_bench and decode_bench print: one column per key of the rows."""


def print_rows(title: str, rows: list[dict]) -> None:
  print(f'\n{title}')
  keys = list(rows[0])
  fmt = lambda v: f'{v:,.4g}' if isinstance(v, float) else str(v)
  cells = [[fmt(r.get(k, '')) for k in keys] for r in rows]
  widths = [max(len(k), *(len(c[i]) for c in cells)) for i, k in enumerate(keys)]
  print('  '.join(k.rjust(w) for k, w in zip(keys, widths)))
  for c in cells:
    print('  '.join(x.rjust(w) for x, w in zip(c, widths)))
