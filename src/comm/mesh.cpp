#include "comm/mesh.h"

#include "core/error.h"

namespace dtrain::comm {

const char* mesh_dim_name(MeshDim d) {
  switch (d) {
    case MeshDim::Pipeline: return "pp";
    case MeshDim::Data: return "dp";
    case MeshDim::Tensor: return "tp";
  }
  return "?";
}

DeviceMesh::DeviceMesh(int pipeline, int data, int tensor) : dims_{pipeline, data, tensor} {
  for (MeshDim d : {MeshDim::Pipeline, MeshDim::Data, MeshDim::Tensor})
    if (size(d) < 1) user_error("device mesh {}: the {} size must be at least 1", str(), mesh_dim_name(d));
}

std::string DeviceMesh::str() const { return fmt::format("pp={} x dp={} x tp={}", dims_[0], dims_[1], dims_[2]); }

MeshCoord DeviceMesh::coord(int rank) const {
  if (rank < 0 || rank >= world()) user_error("device mesh {}: rank {} is not in [0, {})", str(), rank, world());
  const int T = dims_[2], D = dims_[1];
  return MeshCoord{rank / (D * T), (rank / T) % D, rank % T};
}

int DeviceMesh::rank_of(const MeshCoord& c) const {
  for (MeshDim d : {MeshDim::Pipeline, MeshDim::Data, MeshDim::Tensor})
    if (c[d] < 0 || c[d] >= size(d))
      user_error("device mesh {}: {} coordinate {} is not in [0, {})", str(), mesh_dim_name(d), c[d], size(d));
  return c.pipeline * (dims_[1] * dims_[2]) + c.data * dims_[2] + c.tensor;
}

std::vector<int> DeviceMesh::group(MeshDim d, int rank) const {
  MeshCoord c = coord(rank);
  std::vector<int> out;
  for (int k = 0; k < size(d); ++k) {
    MeshCoord m = c;
    (d == MeshDim::Pipeline ? m.pipeline : d == MeshDim::Data ? m.data : m.tensor) = k;
    out.push_back(rank_of(m));
  }
  return out;
}

std::vector<std::vector<int>> DeviceMesh::groups(MeshDim d) const {
  std::vector<std::vector<int>> out;
  for (int r = 0; r < world(); ++r)
    if (coord(r)[d] == 0) out.push_back(group(d, r));  // rank r leads its group
  return out;
}

void DeviceMesh::check_shard(int s) const {
  if (s < 1 || dims_[1] % s != 0)
    user_error("device mesh {}: shard group size {} must be at least 1 and divide the data size {}", str(), s,
               dims_[1]);
}

std::vector<int> DeviceMesh::shard_group(int rank, int s) const {
  check_shard(s);
  MeshCoord c = coord(rank);
  std::vector<int> out;
  for (int k = c.data / s * s; k < (c.data / s + 1) * s; ++k) out.push_back(rank_of({c.pipeline, k, c.tensor}));
  return out;
}

std::vector<int> DeviceMesh::replicate_group(int rank, int s) const {
  check_shard(s);
  MeshCoord c = coord(rank);
  std::vector<int> out;
  for (int k = c.data % s; k < dims_[1]; k += s) out.push_back(rank_of({c.pipeline, k, c.tensor}));
  return out;
}

MeshComms split_mesh(Communicator& parent, const DeviceMesh& mesh, int shard_group_size) {
  if (parent.size() != mesh.world())
    user_error("device mesh {} has {} ranks, but {} has {}", mesh.str(), mesh.world(),
               group_label(parent.group_name(), parent.global_ranks()), parent.size());
  if (shard_group_size > 0) mesh.shard_group(0, shard_group_size);  // UserError before any split
  const int r = parent.rank();
  MeshComms m;
  m.pipeline = parent.split(mesh_dim_name(MeshDim::Pipeline), mesh.group(MeshDim::Pipeline, r));
  m.data = parent.split(mesh_dim_name(MeshDim::Data), mesh.group(MeshDim::Data, r));
  m.tensor = parent.split(mesh_dim_name(MeshDim::Tensor), mesh.group(MeshDim::Tensor, r));
  if (shard_group_size > 0) {
    m.shard = parent.split("dp_shard", mesh.shard_group(r, shard_group_size));
    m.replicate = parent.split("dp_replicate", mesh.replicate_group(r, shard_group_size));
  }
  return m;
}

}  // namespace dtrain::comm
