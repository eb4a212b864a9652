"""The report pages (``--html``): one self-contained HTML file each, a model's grid
(:mod:`~sdpa_cli.render.pages.model`), a check's verdict and where its errors sit
(:mod:`~sdpa_cli.render.pages.check`), a slice's stages
(:mod:`~sdpa_cli.render.pages.slice`), on one page shell and one heat map
(:mod:`~sdpa_cli.render.pages.html`, :mod:`~sdpa_cli.render.pages.images`)."""
