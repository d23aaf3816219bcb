"""Figures and tables of the HTML report (``snakemake --report``)."""
