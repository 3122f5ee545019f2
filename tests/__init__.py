"""fedparity's test suite: a package, so that tests, benchmarks and the processes they start
import the support code as ``tests.support.<module>`` from the repository's folder."""
