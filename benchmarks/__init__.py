"""fedparity's benchmarks: scripts run from the repository's folder as modules
(``python -m benchmarks.<name>``), so that they import the tests' support code as
``tests.support.<module>`` without editing ``sys.path``. A regular package, so that it wins over
the ``benchmarks`` package an installed dependency (Opacus) ships."""
