"""The Python API under the command line: a case in, a result out.

A :class:`~sdpa_cli.api.case.Case` names a computation as its user typed it (files,
options, the exports to judge); the runners read and judge it (:mod:`.judge`,
:mod:`.check`: one case, or a manifest's cases in processes, a shard of them, on a Dask
cluster; :mod:`.merge`: shards' reports merged), compute it (:mod:`.compute`,
:mod:`.grad`, :mod:`.explain`) or measure a model's heads (:mod:`.model`); the files a
run writes are one record written by one function (:mod:`.outputs`). Each command of
the command line is parsing, one call here, rendering and an exit code.

Nothing is imported with the package: ``sdpa --help`` reads the records' modules alone.
"""
