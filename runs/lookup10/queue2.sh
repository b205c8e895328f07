#!/bin/bash
while [ ! -f /tmp/h10a/long9999.done ]; do sleep 5; done
/tmp/h10a/measure_c.sh base-b6 0 0 issue17-bench6
/tmp/h10a/measure_c.sh long9899-b6 0.98 0.99 issue17-bench6
/tmp/h10a/measure_c.sh base-blas 0 0 blas9-mkl
/tmp/h10a/measure_c.sh long9899-blas 0.98 0.99 blas9-mkl
