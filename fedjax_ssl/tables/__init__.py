"""Result tables: a grid of runs (rows x columns -> config overrides) over seeds, summarised next to
the paper's numbers.

A table file (configs/<paper>/<table>.py) defines `get_table(scale) -> Table`. `experiments.reproduce`
turns it into runs, one workdir per distinct config and seed, and this module turns the runs'
`results.json` into `table.csv`, `table.md` and `table.png`, and their `metrics.jsonl` into
`curves.png` (the kNN monitor against rounds):

  table = tables.load_table('configs/fedssl/fmnist.py', 'quick')
  runs = tables.plan_runs(table, seeds=(0, 1, 2))      # every config validated, nothing computed
  ... run each RunSpec through fedjax_ssl.runs.training.train_and_evaluate(run.config, run.workdir(out))
  summary = tables.summarize(table, runs, out)
  tables.write_outputs(table, summary, out, seeds)
  tables.plot_curves(table, tables.curves(table, runs, out), out / 'curves.png')

Cells whose final configs are identical share one run (e.g. centralized training, which ignores the
partition column), so a table never trains the same thing twice.

The API is this module's names; they live by concern in `tables.schema` (the table, its cells and
runs), `tables.stats` (summaries, verdicts, collapse, references) and `tables.render` (csv, markdown,
plots).
"""
from fedjax_ssl.tables.schema import (DEFAULT_TABLE_SCALES, METRICS, RANDOM_INIT, RAW_PIXELS,
                                      SCALES, Claim, RunSpec, Table, cell_config, cell_id,
                                      check_table, cohort_metric, load_table, metric_name,
                                      plan_runs, reference_rows, run_status, seeds_on_disk,
                                      select_cells, slug, table_runs, with_overrides)
from fedjax_ssl.tables.stats import (COLLAPSE_MARGIN, COLLAPSE_METRICS, REFERENCE_TOLERANCE,
                                     carry_over, collapsed_seeds, fill_references, mark_collapsed,
                                     run_metric, summarize, verdict, verdicts, without_references)
from fedjax_ssl.tables.render import (CSV_FIELDS, curves, markdown, plot, plot_curves, read_csv,
                                      write_csv, write_outputs)

__all__ = [
    'DEFAULT_TABLE_SCALES', 'METRICS', 'RANDOM_INIT', 'RAW_PIXELS', 'SCALES', 'Claim', 'RunSpec',
    'Table', 'cell_config', 'cell_id', 'check_table', 'cohort_metric', 'load_table', 'metric_name',
    'plan_runs', 'reference_rows', 'run_status', 'seeds_on_disk', 'select_cells', 'slug',
    'table_runs', 'with_overrides', 'COLLAPSE_MARGIN', 'COLLAPSE_METRICS', 'REFERENCE_TOLERANCE',
    'carry_over', 'collapsed_seeds', 'fill_references', 'mark_collapsed', 'run_metric',
    'summarize', 'verdict', 'verdicts', 'without_references', 'CSV_FIELDS', 'curves', 'markdown',
    'plot', 'plot_curves', 'read_csv', 'write_csv', 'write_outputs',
]
