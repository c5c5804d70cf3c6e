"""File formats behind the data sets: Jena's CSV, SST-2's TSV, their tensorflow-datasets builders,
and config-field readers. Each reads files only; none imports a data set module."""
