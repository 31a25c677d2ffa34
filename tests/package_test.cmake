# ctest's "package" test: installs this build into a scratch prefix, then configures and builds
# examples/cpp_consumer against it with find_package(flexc) (Unix Makefiles, so that generator is
# exercised too) and runs it; then builds the consumer again with flexc's source tree added as a
# subdirectory (Ninja; only what the consumer needs) and runs that.
#   cmake -DBUILD=<flexc build> -DSOURCE=<flexc source> -DWORK=<scratch dir> -P package_test.cmake
file(REMOVE_RECURSE ${WORK})
function(run)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    string(JOIN " " cmd ${ARGN})
    message(FATAL_ERROR "failed (${rc}): ${cmd}")
  endif()
endfunction()
run(${CMAKE_COMMAND} --install ${BUILD} --prefix ${WORK}/prefix)
run(${CMAKE_COMMAND} -S ${SOURCE}/examples/cpp_consumer -B ${WORK}/consumer -G "Unix Makefiles"
    -DCMAKE_PREFIX_PATH=${WORK}/prefix -DCMAKE_BUILD_TYPE=Release)
run(${CMAKE_COMMAND} --build ${WORK}/consumer -j 2)
run(${WORK}/consumer/flexc_consumer)
run(${WORK}/prefix/bin/flexc check @causal)
run(${CMAKE_COMMAND} -S ${SOURCE}/examples/cpp_consumer -B ${WORK}/subdirectory -G Ninja
    -DFLEXC_SOURCE_DIR=${SOURCE} -DCMAKE_BUILD_TYPE=Release)
run(${CMAKE_COMMAND} --build ${WORK}/subdirectory --target flexc_consumer)
run(${WORK}/subdirectory/flexc_consumer)
