#include "cpu/mpi_util.hpp"

#include <climits>

namespace a2a {

std::string mpi_error_text(int code) {
  char text[MPI_MAX_ERROR_STRING];
  int length = 0;
  if (MPI_Error_string(code, text, &length) != MPI_SUCCESS) return cat("MPI error code ", code);
  return std::string(text, static_cast<size_t>(length));
}

namespace {

// A datatype of exactly `bytes` contiguous bytes, built from pieces of at most
// `unit` bytes so that no int count overflows (the BigMPI construction).
MPI_Datatype contiguous_bytes_type(size_t bytes, size_t unit) {
  MPI_Datatype type;
  if (bytes <= unit) {
    A2A_MPI_TYPE_CHECK(MPI_Type_contiguous(static_cast<int>(bytes), MPI_BYTE, &type));
    return type;
  }
  const size_t full = bytes / unit, rest = bytes % unit;
  if (full > static_cast<size_t>(INT_MAX)) fail(A2A_ERROR_UNSUPPORTED, "message of ", bytes, " bytes is too large");
  MPI_Datatype unit_type, full_type;
  A2A_MPI_TYPE_CHECK(MPI_Type_contiguous(static_cast<int>(unit), MPI_BYTE, &unit_type));
  const int full_rc = MPI_Type_contiguous(static_cast<int>(full), unit_type, &full_type);
  MPI_Type_free(&unit_type);
  A2A_MPI_TYPE_CHECK(full_rc);
  if (rest == 0) return full_type;
  MPI_Datatype rest_type;
  const int rest_rc = MPI_Type_contiguous(static_cast<int>(rest), MPI_BYTE, &rest_type);
  if (rest_rc != MPI_SUCCESS) MPI_Type_free(&full_type);
  A2A_MPI_TYPE_CHECK(rest_rc);
  int lengths[2] = {1, 1};
  MPI_Aint displacements[2] = {0, static_cast<MPI_Aint>(full * unit)};
  MPI_Datatype types[2] = {full_type, rest_type};
  const int struct_rc = MPI_Type_create_struct(2, lengths, displacements, types, &type);
  MPI_Type_free(&full_type);
  MPI_Type_free(&rest_type);
  A2A_MPI_TYPE_CHECK(struct_rc);
  return type;
}

}  // namespace

MPI_Datatype span_type(const Span& span, size_t max_count, int rank) {
  MPI_Datatype type;
  if (span.is_contiguous()) {
    type = contiguous_bytes_type(span.bytes(), max_count);
  } else {
    if (span.num_blocks > static_cast<size_t>(INT_MAX))
      fail(A2A_ERROR_UNSUPPORTED, "rank ", rank, ": a layout of ", span.num_blocks, " blocks exceeds MPI's int count");
    MPI_Datatype block = contiguous_bytes_type(span.block_bytes, max_count);
    const int rc = MPI_Type_create_hvector(static_cast<int>(span.num_blocks), 1, static_cast<MPI_Aint>(span.stride_bytes),
                                           block, &type);
    MPI_Type_free(&block);
    A2A_MPI_TYPE_CHECK(rc);
  }
  const int rc = MPI_Type_commit(&type);
  if (rc != MPI_SUCCESS) MPI_Type_free(&type);
  A2A_MPI_TYPE_CHECK(rc);
  return type;
}

}  // namespace a2a
